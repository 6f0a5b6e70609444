"""Shared state: named tensors that every peer of a group must hold bit for bit."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, TextIO

from ._tensors import _byte_view, hash_tensor


@dataclass(frozen=True)
class SyncInfo:
    """What :meth:`Communicator.sync_shared_state` did."""

    revision: int
    """The revision every participant is at now."""
    received: dict[str, list[int]]
    """Tensors this peer received, each with the peer ids it fetched them from."""
    received_bytes: int
    sent_to: list[int]
    """Peers this peer sent tensor bytes to."""
    sent_bytes: int
    elapsed: float


@dataclass(frozen=True)
class CatchUpProgress:
    """How far a catch-up (``Communicator.connect(catch_up=state)``) is."""

    done: int
    """Bytes fetched so far."""
    total: int
    """Bytes to fetch."""
    elapsed: float
    """Seconds since the fetch began."""
    eta: Optional[float]
    """Seconds left at the rate so far; ``None`` before any byte arrived."""


@dataclass(frozen=True)
class CatchUpInfo:
    """What ``Communicator.connect(catch_up=state)`` fetched before the admission."""

    revision: Optional[int]
    """The revision now in the state; ``None`` if nothing was fetched (the sync after the
    admission repairs the state, as without a catch-up)."""
    fetched_bytes: int
    donors: list[int]
    """The peer ids that delivered a piece; if nothing was fetched, those it asked."""
    skipped: Optional[str]
    """Why nothing was fetched, if nothing was."""
    elapsed: float


def progress_line(p: CatchUpProgress, width: int = 30) -> str:
    """A catch-up's progress as one line: a bar, the share, bytes, rate and time left."""
    share = p.done / p.total if p.total else 1.0
    rate = p.done / p.elapsed / 1e6 if p.elapsed > 0 else 0.0
    eta = "?" if p.eta is None else f"{p.eta:.0f} s"
    return (f"catching up [{'#' * int(share * width):<{width}}] {share:4.0%} {p.done >> 20}/{p.total >> 20} MiB "
            f"{rate:.0f} MB/s, {eta} left")


class ProgressBar:
    """Draws a catch-up's progress on one line of ``out`` (stderr): bytes, rate and time left."""

    def __init__(self, out: Optional[TextIO] = None, width: int = 30):
        self.out = out or sys.stderr
        self.width = width
        self.drawn = False
        self.last = 0.0

    def __call__(self, p: CatchUpProgress) -> None:
        now = time.monotonic()
        if p.done < p.total and now - self.last < 0.2:
            return
        self.last = now
        self.out.write("\r" + progress_line(p, self.width) + " ")
        self.out.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.out.write("\n")
            self.out.flush()


class SharedState:
    """Named tensors (numpy arrays or torch CPU tensors, any dtype shoal supports, any shape)
    plus a revision, e.g. the training step. ``sync_shared_state`` makes every peer's tensors
    equal to the elected ones in place and advances ``revision``.

    ``allowed_to_differ`` names tensors that may legitimately differ between peers (per-peer RNG
    or data-loader state): they are never repaired among accepted peers, but a newcomer receives
    them.
    """

    def __init__(self, tensors: Mapping[str, Any], revision: int = 0, *, allowed_to_differ: Iterable[str] = ()):
        if isinstance(revision, bool) or not isinstance(revision, int) or not 0 <= revision < 2**64:
            raise ValueError(f"revision must be an integer from 0 to 2**64 - 1, got {revision!r}")
        self.tensors = dict(tensors)
        for name, t in self.tensors.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
            _byte_view(t)  # TypeError/ValueError now, not halfway through a sync
        self.allowed_to_differ = frozenset(allowed_to_differ)
        unknown = self.allowed_to_differ - self.tensors.keys()
        if unknown:
            raise ValueError(f"allowed_to_differ names tensors not in the state: {sorted(unknown)}")
        self.revision = revision

    def hashes(self) -> dict[str, str]:
        """Each tensor's content hash (:func:`shoal.hash_tensor`)."""
        return {name: hash_tensor(t) for name, t in self.tensors.items()}

    def _native_entries(self) -> list[tuple[str, Any, str, list[int], bool]]:
        entries = []
        for name, t in self.tensors.items():
            view, dtype = _byte_view(t)
            entries.append((name, view, dtype, [int(d) for d in t.shape], name in self.allowed_to_differ))
        return entries
