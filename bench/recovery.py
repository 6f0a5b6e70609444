"""How fast a run recovers from a lost peer, and how fast calls that cannot complete together end.

Recovery: peers all-reduce in a loop; one is killed (SIGKILL) or frozen (SIGSTOP). Reports, per
survivor, the time from the signal to its PeerLostError (if it saw one: a survivor between calls
sees none) and to its first success in the smaller world, for the README's loop (update_topology
after the error) and the retry-only loop (``except PeerLostError: continue``).

Mismatched calls: peer 0 calls peers_pending while the others all-reduce; reports how long after
peer 0's call every call ended (with UsageError).

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


def worker(master: str, peers: int, mib: int, mode: str, index: int) -> None:
    comm = shoal.Communicator(master, timeout=120)
    comm.connect(timeout=60)
    while comm.group_world_size < peers:
        if comm.peers_pending():
            comm.update_topology()
    comm.all_reduce(np.ones(1, np.float32))  # everyone is in, and past its first call
    print("ready", flush=True)
    if mode == "mismatch":
        time.sleep(0.5)
        started = time.time()
        try:
            comm.peers_pending() if index == 0 else comm.all_reduce(np.ones(mib << 18, np.float32))
        except shoal.UsageError:
            pass
        print(json.dumps({"started": started, "ended": time.time()}), flush=True)
        return
    x = np.ones(mib << 18, np.float32)
    error_at = None
    while True:
        try:
            info = comm.all_reduce(x, op="avg")
        except shoal.PeerLostError:
            error_at = error_at or time.time()
            if mode == "readme":
                comm.update_topology()
            continue
        except shoal.KickedError:
            return
        if info.world_size < peers:
            print(json.dumps({"error_at": error_at, "recovered_at": time.time()}), flush=True)
            return


def start(master: shoal.Master, args: argparse.Namespace, mode: str) -> list[subprocess.Popen]:
    procs = []
    for i in range(args.peers):
        argv = [sys.executable, os.path.abspath(__file__), "--worker", master.address, str(args.peers),
                str(args.mib), mode, str(i)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
        time.sleep(0.2)
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.0f} ms (max {max(seconds) * 1e3:.0f})"


def recovery(args: argparse.Namespace, mode: str, sig: signal.Signals) -> None:
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=args.heartbeat_timeout) as master:
        procs = start(master, args, mode)
        time.sleep(1.0)
        victim = procs[1]
        t0 = time.time()
        victim.send_signal(sig)
        results = [json.loads(p.stdout.readline()) for p in procs if p is not victim]
        if sig == signal.SIGSTOP:
            victim.send_signal(signal.SIGCONT)
        for p in procs:
            p.communicate(timeout=60)
    errors = [r["error_at"] - t0 for r in results if r["error_at"]]
    seen = f"error after {ms(errors)} on {len(errors)} of {len(results)}" if errors else "no survivor saw an error"
    print(f"{mode:>6} {sig.name}: {args.peers} peers, {args.mib} MiB, heartbeat timeout {args.heartbeat_timeout} s: "
          f"{seen}; success in the smaller world after {ms([r['recovered_at'] - t0 for r in results])}", flush=True)


def mismatch(args: argparse.Namespace) -> None:
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=args.heartbeat_timeout) as master:
        procs = start(master, args, "mismatch")
        results = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in procs]
    t0 = results[0]["started"]
    print(f"mismatched calls (peers_pending vs all_reduce of {args.mib} MiB), heartbeat interval "
          f"{args.heartbeat_timeout / 4 * 1e3:.0f} ms: every call ended "
          f"{ms([r['ended'] - t0 for r in results])} after the odd call began", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        master, peers, mib, mode, index = args.worker
        return worker(master, int(peers), int(mib), mode, int(index))
    for mode in ("retry", "readme"):
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            recovery(args, mode, sig)
    mismatch(args)


if __name__ == "__main__":
    main()
