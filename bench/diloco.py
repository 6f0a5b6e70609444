"""What DiLoCo's outer step costs in communication next to a bare all-reduce of the same bytes,
and how much of it AsyncDiLoCo hides behind compute.

Peers hold a float32 model of ``--mib`` MiB; every peer times ``--rounds`` of (a) a bare
``all_reduce(avg)`` of a buffer of the model's size, then of (b) ``DiLoCo.outer_step()``: the
answer of the ``peers_pending`` vote cast ahead at the last outer step, the all-reduce of the
pseudo-gradients and the outer update (Nesterov SGD on the anchor, the model set to it). Its
communication is the time spent waiting on the vote and in the all-reduce. Prints the medians of
peer 0 and the ratios.

With ``--async``, (b) is ``--compute`` seconds of inner steps, then ``AsyncDiLoCo.outer_step()``,
which waits for the all-reduce started one outer step earlier (it ran during the compute), takes
the answer of the peers_pending vote cast ahead (``peers_pending_async``) and starts the next. The time the
loop waits there on communication (the wait, a vote, the start), next to the bare all-reduce,
says how much of the all-reduce the compute hid; the outer update's arithmetic is reported apart. The compute is a sleep: a GPU's work, which leaves the host's
cores to shoal (on this 2-core machine, 4 peers computing on the CPU would measure the CPU).

``--lab PROFILE`` runs the master on the lab's first host and a peer on each host
(``docs/lab.md``; root), e.g. on two sites 40 ms apart at 100 Mbit/s:

    python bench/diloco.py --peers 3 --mib 16 --rounds 10
    python bench/diloco.py --lab two-sites --rate 100mbit --peers 4 --mib 16 --async --compute 4
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import shoal


def worker(master: str, args: argparse.Namespace) -> None:
    import torch
    from shoal.torch import AsyncDiLoCo, DiLoCo

    torch.set_num_threads(1)  # each peer its own core, as on its own machine
    comm = shoal.Communicator(master, timeout=300)
    comm.connect(timeout=120, min_world_size=args.peers)
    n = args.mib << 18
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(n))
    diloco = (AsyncDiLoCo if args.async_ else DiLoCo)(comm, [weight], inner_steps=1)
    diloco.join()
    bare, outer, talk, votes = [], [], [], []
    inside = [0.0, 0.0]  # all communication, of which votes

    def timed(call, vote=False):  # the communicator's calls, timed where they block the training loop
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return call(*a, **kw)
            finally:
                inside[0] += time.perf_counter() - t
                inside[1] += (time.perf_counter() - t) * vote
        return run

    def started(call, vote=False):  # all_reduce_async, peers_pending_async: the start, and the wait
        def run(*a, **kw):
            work = timed(call, vote)(*a, **kw)
            work.wait = timed(work.wait, vote)
            return work
        return run

    comm.all_reduce, comm.all_reduce_async = timed(comm.all_reduce), started(comm.all_reduce_async)
    comm.peers_pending = timed(comm.peers_pending, vote=True)
    comm.peers_pending_async = started(comm.peers_pending_async, vote=True)
    buffer = torch.ones(n)

    scratch = torch.empty(n)

    def time_bare() -> None:
        # As an outer step starts: after the compute and the pseudo-gradient's pass, whose
        # length differs a little from peer to peer (the all-reduce waits for the last).
        time.sleep(args.compute)
        torch.sub(buffer, weight.detach(), out=scratch)
        t = time.perf_counter()
        comm.all_reduce(buffer, op="avg")
        bare.append(time.perf_counter() - t)

    # AsyncDiLoCo's all-reduce in flight would share the links: bare ones go first, alone.
    # DiLoCo's alternate with its outer steps, side by side (after --compute, the vote cast
    # ahead has its answer: a collective started while it is out would wait for it).
    for _ in range(args.rounds if args.async_ else 0):
        time_bare()
    for i in range(args.rounds + args.async_):
        if not args.async_:
            time_bare()
        with torch.no_grad():
            weight.add_(0.001)
        time.sleep(args.compute)
        inside[:] = [0.0, 0.0]
        t = time.perf_counter()
        diloco.outer_step()
        if i or not args.async_:  # the first async outer step has nothing in flight to wait for
            outer.append(time.perf_counter() - t)
            talk.append(inside[0])
            votes.append(inside[1])
    diloco.finish()
    if comm.rank == 0:
        b, o, c = statistics.median(bare), statistics.median(outer), statistics.median(talk)
        v = statistics.median(votes)
        where = f"lab {args.lab}" + (f" at {args.rate}" if args.rate else "") if args.lab else "loopback"
        head = f"{where}, {args.peers} peers, {args.mib} MiB: bare all_reduce {b * 1e3:.1f} ms; "
        if args.async_:
            print(head + f"after {args.compute:g} s of compute, AsyncDiLoCo's outer step takes {o * 1e3:.1f} ms, "
                  f"of which {c * 1e3:.1f} ms waiting on communication: {1 - c / b:.1%} of the all-reduce hidden",
                  flush=True)
        else:
            print(head + f"DiLoCo outer step {o * 1e3:.1f} ms ({o / b:.2f}x), of which communication "
                  f"{c * 1e3:.1f} ms ({c / b:.2f}x; the vote's answer {v * 1e3:.1f} ms)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--async", dest="async_", action="store_true", help="AsyncDiLoCo behind --compute")
    parser.add_argument("--compute", type=float, default=0.0, help="seconds of inner steps per outer step")
    parser.add_argument("--lab", help="a lab profile: master and peers on its hosts")
    parser.add_argument("--rate", help="the lab's link cap, e.g. 100mbit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args)
    argv = sys.argv[1:]
    if args.lab is None:
        with shoal.Master("127.0.0.1:0") as master:
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", master.address, *argv])
                     for _ in range(args.peers)]
            codes = [p.wait(timeout=900) for p in procs]
    else:
        from shoal.lab import PROFILES, Lab

        with Lab.up(PROFILES[args.lab], name="bench-diloco", subnet="10.209.0.0/24", ttl=1200,
                    **({"rate": args.rate} if args.rate else {})) as lab:
            hosts = [lab.hosts[i % len(lab.hosts)] for i in range(args.peers)]
            with lab.master(hosts[0]) as master:
                procs = [lab.popen(h, [sys.executable, __file__, "--worker", master, *argv]) for h in hosts]
                codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise SystemExit(f"a peer failed: {codes}")


if __name__ == "__main__":
    main()
