"""How fast a run recovers from a lost peer: 4 peers all-reduce 64 MiB in a loop; one is killed
(SIGKILL) or frozen (SIGSTOP). Reports, per survivor, the time from the signal to its
PeerLostError and to its next successful all-reduce.

    python bench/recovery.py --peers 4 --mib 64 --heartbeat-timeout 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import shoal


def worker(master: str, peers: int, mib: int) -> None:
    comm = shoal.Communicator(master, timeout=120)
    comm.connect(timeout=60)
    while comm.group_world_size < peers:
        if comm.peers_pending():
            comm.update_topology()
    print("ready", flush=True)
    x = np.ones(mib << 18, np.float32)
    lost_at = None
    while True:
        try:
            comm.all_reduce(x, op="avg")
        except shoal.PeerLostError:
            lost_at = time.time()
            comm.update_topology()
            continue
        except shoal.KickedError:
            return
        if lost_at is not None:
            print(json.dumps({"error_at": lost_at, "recovered_at": time.time()}), flush=True)
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        with shoal.Master("127.0.0.1:0", heartbeat_timeout=args.heartbeat_timeout) as master:
            argv = [sys.executable, os.path.abspath(__file__), "--worker", master.address, str(args.peers), str(args.mib)]
            procs = []
            for _ in range(args.peers):
                procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
                time.sleep(0.2)
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
            time.sleep(1.0)
            victim = procs[1]
            t0 = time.time()
            victim.send_signal(sig)
            results = [json.loads(p.stdout.readline()) for p in procs if p is not victim]
            if sig == signal.SIGSTOP:
                victim.send_signal(signal.SIGCONT)
            for p in procs:
                p.communicate(timeout=60)
        err = [r["error_at"] - t0 for r in results]
        rec = [r["recovered_at"] - t0 for r in results]
        print(f"{sig.name}: {args.peers} peers, {args.mib} MiB, heartbeat timeout {args.heartbeat_timeout} s: "
              f"error after {statistics.median(err) * 1e3:.0f} ms (max {max(err) * 1e3:.0f}), "
              f"next success after {statistics.median(rec) * 1e3:.0f} ms (max {max(rec) * 1e3:.0f})", flush=True)


if __name__ == "__main__":
    main()
