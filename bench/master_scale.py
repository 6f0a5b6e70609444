"""What idle peers cost a master, and how fast its status page answers, as their number grows.

For each count N: a ``shoal master`` process, then N peers in this process (each a
``shoal.Communicator`` in a peer group of its own, so each is admitted alone and nobody votes),
connected and then idle (heartbeats alone) for ``--seconds``. Reports the master's CPU time per
second over that window (from ``/proc``), its resident memory, and the median and slowest of
``--fetches`` GETs of ``/status`` and ``/metrics``.

    python bench/master_scale.py --peers 10 100 1000 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import shoal

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fetch_times(url: str, count: int) -> tuple[float, float]:
    took = []
    for _ in range(count):
        t = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as r:
            r.read()
        took.append(time.perf_counter() - t)
    return statistics.median(took) * 1e3, max(took) * 1e3


def measure(peers: int, seconds: float, fetches: int, heartbeat: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    master = subprocess.Popen([sys.executable, "-m", "shoal.cli", "master", "--listen", "127.0.0.1:0", "--http",
                               "127.0.0.1:0", "--heartbeat-timeout", str(heartbeat)], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert master.stdout is not None
        address = master.stdout.readline().split()[-1]
        http = next(w for w in master.stdout.readline().split() if w.startswith("http://"))
        comms = [shoal.Communicator(address, peer_group=g + 1, timeout=120, heartbeat_timeout=heartbeat)
                 for g in range(peers)]
        started = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            list(pool.map(lambda c: c.connect(timeout=120), comms))
        joined = time.monotonic() - started
        time.sleep(min(5.0, seconds))  # the joins' work settles
        cpu, wall = cpu_seconds(master.pid), time.monotonic()
        time.sleep(seconds)
        idle = (cpu_seconds(master.pid) - cpu) / (time.monotonic() - wall)
        status = fetch_times(f"{http.rstrip('/')}/status", fetches)
        metrics = fetch_times(f"{http.rstrip('/')}/metrics", fetches)
        row = {"peers": peers, "join_s": joined, "idle_core_share": idle, "rss_mib": rss_mib(master.pid),
               "status_ms": status, "metrics_ms": metrics}
        for c in comms:
            c.close()
        return row
    finally:
        master.terminate()
        master.communicate(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--seconds", type=float, default=20.0, help="idle window measured")
    parser.add_argument("--fetches", type=int, default=20)
    parser.add_argument("--heartbeat", type=float, default=15.0, help="the heartbeat timeout (s)")
    args = parser.parse_args()
    print("peers  join(s)  master CPU idle  RSS(MiB)  /status median/max (ms)  /metrics median/max (ms)")
    for n in args.peers:
        r = measure(n, args.seconds, args.fetches, args.heartbeat)
        print(f"{n:5}  {r['join_s']:7.1f}  {r['idle_core_share'] * 100:14.2f}%  {r['rss_mib']:8.1f}  "
              f"{r['status_ms'][0]:10.1f} / {r['status_ms'][1]:6.1f}      "
              f"{r['metrics_ms'][0]:10.1f} / {r['metrics_ms'][1]:6.1f}", flush=True)
        print(json.dumps(r), file=sys.stderr)


if __name__ == "__main__":
    main()
