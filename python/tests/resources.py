"""What a soak's processes hold over time: resident memory, threads and open descriptors, read
from ``/proc`` about once a second, and whether each stayed flat after its warm-up (a leak, a
thread or a descriptor per operation, shows as growth past a named slack). ``chaos.py`` watches
its peers with a :class:`Sampler`."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Optional

# Growth a process may show after its warm-up before it counts as a leak: caches, pools and
# buffers settle within WARMUP; what grows past these keeps growing with the run.
WARMUP = 30.0
SLACK = {"rss_mib": 64.0, "threads": 16, "fds": 64}


@dataclass(frozen=True)
class Sample:
    """One reading: seconds since the sampler started, and what the process held."""
    t: float
    rss_mib: float
    threads: int
    fds: int


def sample(pid: int, t: float = 0.0) -> Optional[Sample]:
    """What process ``pid`` holds now, or ``None`` if it is gone (or not ours to read)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        return None  # exited, not yet reaped: it holds nothing any more
    rss_kib = int(fields["VmRSS"].split()[0]) if "VmRSS" in fields else 0
    return Sample(t, rss_kib / 1024, int(fields["Threads"]), fds)


def growth(curve: list[Sample], warmup: float = WARMUP) -> Optional[dict[str, float]]:
    """How far each of memory, threads and descriptors rose from its level at the end of the
    warm-up (``warmup`` seconds after the first reading) to its level at the end, or ``None`` if
    the curve does not reach past the warm-up. A level is the median of a fifth of the readings
    after the warm-up (at least one, at most 30): what a leak raises, where a passing peak (the
    buffers of a measurement, a repair) does not count."""
    after = [s for s in curve if s.t - curve[0].t >= warmup] if curve else []
    if len(after) < 2:
        return None
    n = max(1, min(30, len(after) // 5))
    return {k: median(getattr(s, k) for s in after[-n:]) - median(getattr(s, k) for s in after[:n]) for k in SLACK}


def leaks(curves: dict[str, list[Sample]], warmup: float = WARMUP,
          slack: Optional[dict[str, float]] = None) -> list[str]:
    """Every process whose growth after its warm-up passed ``slack`` (default :data:`SLACK`),
    named with what grew and by how much."""
    slack = slack or SLACK
    found = []
    for name, curve in curves.items():
        grew = growth(curve, warmup)
        for k, v in (grew or {}).items():
            if v > slack[k]:
                found.append(f"{name}: {k} grew by {v:g} after its warm-up (slack {slack[k]:g})")
    return found


@dataclass
class Sampler:
    """Reads every watched process about every ``every`` seconds on a thread of its own, from
    :meth:`start` to :meth:`stop`; a process that is gone stops being read."""
    every: float = 1.0
    curves: dict[str, list[Sample]] = field(default_factory=dict)
    _pids: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None
    _t0: float = field(default_factory=time.monotonic)

    def watch(self, name: str, pid: int) -> None:
        with self._lock:
            self._pids[name] = pid
            self.curves.setdefault(name, [])

    def start(self) -> "Sampler":
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:
                watched = list(self._pids.items())
            for name, pid in watched:
                s = sample(pid, time.monotonic() - self._t0)
                with self._lock:
                    if s is None:
                        self._pids.pop(name, None)
                    else:
                        self.curves[name].append(s)

    def summary(self, warmup: float = WARMUP) -> dict:
        """The most any process held, the most any grew after its warm-up, and the leaks."""
        with self._lock:
            curves = {n: list(c) for n, c in self.curves.items() if c}
        grown = [g for g in (growth(c, warmup) for c in curves.values()) if g]
        peak = {k: max((getattr(s, k) for c in curves.values() for s in c), default=0) for k in SLACK}
        return {"processes": len(curves), "past_warmup": len(grown), "peak": peak,
                "max_growth": {k: max((g[k] for g in grown), default=0) for k in SLACK},
                "leaks": leaks(curves, warmup)}

    def plot(self, path: Path) -> Optional[Path]:
        """The curves as a PNG (memory, threads, descriptors against time, a line per process);
        ``None`` without matplotlib."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        with self._lock:
            curves = {n: list(c) for n, c in self.curves.items() if c}
        fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        labels = [("rss_mib", "resident MiB"), ("threads", "threads"), ("fds", "open descriptors")]
        for ax, (k, label) in zip(axes, labels):
            for name, curve in curves.items():
                # Processes other than the peers (the master) stand out, named; one restarted
                # ("master#2") in the same colour, named once.
                style = {"linewidth": 0.8} if name.startswith("peer") else {
                    "linewidth": 2, "color": "black", "label": name if "#" not in name else "_" + name}
                ax.plot([s.t for s in curve], [getattr(s, k) for s in curve], **style)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel("seconds")
        axes[0].set_title(f"{len(curves)} processes")
        if any(not n.startswith("peer") for n in curves):
            axes[0].legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
