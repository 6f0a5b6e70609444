"""A newcomer joining a training run with a large shared state: the accepted peers' step times
before, during and after the join, and the newcomer's time from connect() to its first step in
sync, with the catch-up and without (the old way: the sync that admits it repairs it).

    python bench/catchup.py --mib 256 --members 3            # both ways, side by side
    python bench/catchup.py --mib 256 --rate 40000000        # donors bounded by SHOAL_CATCHUP_RATE

Every peer is a process of its own on this machine, or with --lab in the hosts of a lab (the
members in the first, the newcomer in the last; `shoal lab up two-sites --rate 100mbit`). Each step: peers_pending (and update_topology if it says so), sync_shared_state of
the whole state, an all-reduce of a 1 MiB gradient, and --compute seconds of "compute". The
state's big tensor changes once, at step 2, and a step counter every step, as an optimizer whose
updates are sparse in time (DiLoCo's outer steps); a run whose every tensor changes every step
moves the whole state again at admission, whatever the catch-up did.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np


def peer(args: argparse.Namespace) -> None:
    import shoal

    comm = shoal.Communicator(args.master, timeout=300)
    w = np.zeros(args.mib << 18, np.float32)
    step = np.zeros(1, np.uint64)
    state = shoal.SharedState({"w": w, "step": step})
    out: dict[str, Any] = {"role": args.role}
    first = False
    if args.role == "newcomer":
        out["connect"] = time.time()
        if args.catch_up:
            info = comm.connect(timeout=300, catch_up=state)
            assert info is not None
            out["caught"] = {"revision": info.revision, "bytes": info.fetched_bytes, "elapsed": info.elapsed}
        else:
            comm.connect(timeout=300)
        out["admitted"] = time.time()
        first = True
    else:
        comm.connect(timeout=60, min_world_size=args.members)
        w[:] = 1.0
        print(json.dumps({"ready": comm.peer_id}), flush=True)
    times = []
    steps_in_whole = 0
    while steps_in_whole < args.steps_after:
        t0 = time.time()
        if not first and comm.peers_pending():
            comm.update_topology()
        first = False
        t1 = time.time()
        state.revision = int(step[0])
        synced = comm.sync_shared_state(state)
        t2 = time.time()
        grad = np.ones(1 << 18, np.float32)
        comm.all_reduce(grad, op="sum")
        t3 = time.time()
        if args.role == "newcomer" and "in_sync" not in out:
            out["in_sync"] = time.time()
            out["admission_bytes"] = synced.received_bytes
        steps_in_whole += comm.group_world_size == args.members + 1
        step[0] += 1
        if step[0] == 2:
            w += 1.0
        time.sleep(args.compute)
        # The step, and its parts: the votes (and admission), the sync, the all-reduce.
        times.append([t0, time.time() - t0, t1 - t0, t2 - t1, t3 - t2])
    out["times"] = times
    print(json.dumps(out), flush=True)


RECEIVE = """
import socket, sys, time
server = socket.create_server(("0.0.0.0", 48149))
print("ready", flush=True)
conn, _ = server.accept()
buf, got, n = bytearray(1 << 22), 0, int(sys.argv[1])
started = time.perf_counter()
while got < n:
    k = conn.recv_into(buf)
    if k == 0:
        break
    got += k
print(time.perf_counter() - started, flush=True)
"""
SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], 48149))
b, n = bytearray(1 << 22), int(sys.argv[2])
while n > 0:
    n -= s.send(memoryview(b)[:min(n, len(b))])
s.close()
"""


def raw_transfer_s(nbytes: int, lab: Any = None, sender: str = "", receiver: str = "") -> float:
    """Seconds to move `nbytes` over one TCP connection between two processes: on loopback, or
    from lab host `sender` to `receiver`."""
    def place(host: str, argv: list[str]) -> list[str]:
        return lab.argv(host, argv) if lab else argv

    rx = subprocess.Popen(place(receiver, [sys.executable, "-c", RECEIVE, str(nbytes)]), stdout=subprocess.PIPE,
                          text=True)
    assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
    to = lab.address(receiver) if lab else "127.0.0.1"
    subprocess.run(place(sender, [sys.executable, "-c", SEND, to, str(nbytes)]), check=True)
    return float(rx.communicate(timeout=600)[0])


def run(args: argparse.Namespace, catch_up: bool, lab: Any, hosts: list[str]) -> dict[str, Any]:
    import shoal

    env = dict(os.environ)
    if args.rate:
        env["SHOAL_CATCHUP_RATE"] = str(args.rate)
    base = [sys.executable, os.path.abspath(__file__), "--mib", str(args.mib), "--members", str(args.members),
            "--steps-after", str(args.steps_after), "--compute", str(args.compute)]

    def place(i: int, argv: list[str]) -> list[str]:
        return lab.argv(hosts[i], argv) if lab else argv

    with contextlib.ExitStack() as stack:
        if lab:
            address = stack.enter_context(lab.master(hosts[0]))
        else:
            address = stack.enter_context(shoal.Master("127.0.0.1:0")).address
        members = [subprocess.Popen(place(i, base + ["--role", "member", "--master", address]),
                                    stdout=subprocess.PIPE, text=True, env=env) for i in range(args.members)]
        for m in members:
            assert m.stdout is not None and "ready" in m.stdout.readline()
        time.sleep(args.warmup)
        argv = base + ["--role", "newcomer", "--master", address] + (["--catch-up"] if catch_up else [])
        newcomer = subprocess.Popen(place(args.members, argv), stdout=subprocess.PIPE, text=True, env=env)
        outs = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in [newcomer, *members]]
    new, members_out = outs[0], outs[1:]
    before = [t[1] for m in members_out for t in m["times"] if t[0] + t[1] < new["connect"]]
    during = [t for m in members_out for t in m["times"] if t[0] + t[1] > new["connect"] and t[0] < new["in_sync"]]
    longest = max(during, key=lambda t: t[1])
    normal_all_reduce = [t[4] for m in members_out for t in m["times"] if t[0] + t[1] < new["connect"]]
    return {
        "normal_step_s": statistics.median(before),
        "normal_all_reduce_s": statistics.median(normal_all_reduce),
        "longest_step_during_join_s": longest[1],
        "longest_step_votes_s": longest[2],
        "longest_step_sync_s": longest[3],
        "longest_step_all_reduce_s": longest[4],
        "connect_to_in_sync_s": new["in_sync"] - new["connect"],
        "admission_sync_bytes": new["admission_bytes"],
        "caught": new.get("caught"),
        "newcomer_first_step": new["times"][0],
        "members_steps_after": [t[1:] for t in members_out[0]["times"] if t[0] > new["in_sync"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--steps-after", type=int, default=4)
    parser.add_argument("--compute", type=float, default=0.2, help="seconds of compute per step")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds the members step before the join")
    parser.add_argument("--catch-up-only", action="store_true", help="skip the run without catching up")
    parser.add_argument("--rate", type=int, default=None, help="SHOAL_CATCHUP_RATE for the donors")
    parser.add_argument("--lab", help="run in the hosts of this lab (shoal lab up), the newcomer in the last")
    parser.add_argument("--hosts", help="comma-separated lab hosts: the members', then the newcomer's")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--catch-up", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        return peer(args)
    lab = hosts = None
    if args.lab:
        from shoal.lab import Lab

        lab = Lab(args.lab)
        hosts = args.hosts.split(",") if args.hosts else list(lab.hosts)
        assert len(hosts) == args.members + 1, f"{args.members} members and a newcomer need {args.members + 1} hosts"
    # The newcomer's own link: from a member in its site (or on loopback), one connection.
    sender = next((h for h in (hosts or [])[:-1] if lab.spec.host(h).site == lab.spec.host(hosts[-1]).site),
                  hosts[0] if hosts else "")
    raw = min(raw_transfer_s((args.mib << 20) + 8, lab, sender, hosts[-1] if hosts else "") for _ in range(2))
    where = f"{sender} -> {hosts[-1]} in lab {args.lab}" if lab else "loopback"
    print(f"raw transfer of {args.mib} MiB over one TCP connection ({where}): {raw:.3f} s")
    results: dict[str, dict[str, Any]] = {}
    ways = (("catch-up", True),) if args.catch_up_only else (("catch-up", True), ("repair at admission", False))
    for name, catch_up in ways:
        r = run(args, catch_up, lab, hosts or [])
        results[name] = r
        print(f"{name:>20}: members' normal step {r['normal_step_s']:.3f} s, longest during the join "
              f"{r['longest_step_during_join_s']:.3f} s ({r['longest_step_during_join_s'] / r['normal_step_s']:.2f}x: "
              f"votes {r['longest_step_votes_s']:.3f} s, sync {r['longest_step_sync_s']:.3f} s, "
              f"all-reduce {r['longest_step_all_reduce_s']:.3f} s against {r['normal_all_reduce_s']:.3f} s); "
              f"newcomer connect -> first step in sync {r['connect_to_in_sync_s']:.2f} s "
              f"({r['connect_to_in_sync_s'] / raw:.2f}x raw); admission sync moved {r['admission_sync_bytes']} bytes")
    print(json.dumps({"raw_transfer_s": raw, **results}))


if __name__ == "__main__":
    main()
