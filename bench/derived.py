"""What a derived group's first collective costs against its steady ones: four peers on loopback.

The four peers warm their group's links with 4 KiB all-reduces (the small-message path links
every pair), then, round after round, ``split`` themselves into two groups of two and time the
new group's first 4 KiB all-reduce and its next ones. A derived group shares the connections of
the group it came from, so its first collective opens nothing: the issue's bound is a first
collective within 2x of a steady one. The floor: the first all-reduce of a group derived before,
right after the same all-gather of the whole group that ``split`` is (the members leave a
collective at different moments, and the next one waits for the last). Reports the medians over
every member and round (ms) and the ratios; ``--json`` for the record.

    python bench/derived.py --rounds 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import shoal

STEADY = 30


def worker(master: str, peers: int, rounds: int) -> None:
    comm = shoal.Communicator(master, timeout=60)
    comm.connect(timeout=60, min_world_size=peers)
    x = np.ones(1024, np.float32)  # 4 KiB
    for _ in range(50):
        comm.all_reduce(x, op="sum")
    old = comm.split(color=comm.rank % 2, key=comm.rank)
    assert old is not None
    mine, everyone = np.zeros(5, np.uint64), np.zeros(5 * peers, np.uint64)
    firsts, floors, steady = [], [], []
    for _ in range(rounds):
        comm.all_gather(everyone, mine)
        t = time.perf_counter()
        old.all_reduce(x, op="sum")
        floors.append(time.perf_counter() - t)
        sub = comm.split(color=comm.rank % 2, key=comm.rank)
        assert sub is not None
        t = time.perf_counter()
        sub.all_reduce(x, op="sum")
        firsts.append(time.perf_counter() - t)
        times = []
        for _ in range(STEADY):
            t = time.perf_counter()
            sub.all_reduce(x, op="sum")
            times.append(time.perf_counter() - t)
        steady.append(statistics.median(times))
    comm.barrier()
    print(json.dumps({"firsts": firsts, "floors": floors, "steady": steady}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    peers = 4
    with shoal.Master("127.0.0.1:0") as master:
        argv = [sys.executable, os.path.abspath(__file__), "--worker", master.address, str(peers), str(args.rounds)]
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(peers)]
        results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    first, floor, steady = (statistics.median(t * 1e3 for r in results for t in r[k])
                            for k in ("firsts", "floors", "steady"))
    figures = {"first_ms": round(first, 3), "floor_ms": round(floor, 3), "steady_ms": round(steady, 3),
               "ratio": round(first / steady, 2), "floor_ratio": round(floor / steady, 2)}
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"groups of 2 out of 4, 4 KiB all-reduce: a new group's first {first:.3f} ms, an old group's first "
              f"after the same all-gather {floor:.3f} ms (the floor), steady {steady:.3f} ms; ratios "
              f"{first / steady:.2f} and {floor / steady:.2f} (bound: 2)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
