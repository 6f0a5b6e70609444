"""Shared state: named tensors that every peer of a group must hold bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ._communicator import _byte_view, hash_tensor


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


class SharedState:
    """Named tensors (numpy arrays or torch CPU tensors, any dtype shoal supports, any shape)
    plus a revision, e.g. the training step. ``sync_shared_state`` makes every peer's tensors
    equal to the elected ones in place and advances ``revision``.

    ``allowed_to_differ`` names tensors that may legitimately differ between peers (per-peer RNG
    or data-loader state): they are never repaired among accepted peers, but a newcomer receives
    them.
    """

    def __init__(self, tensors: Mapping[str, Any], revision: int = 0, *, allowed_to_differ: Iterable[str] = ()):
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
            raise ValueError(f"revision must be a non-negative int, got {revision!r}")
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
