"""What one slow peer costs the others' DiLoCo outer steps, with and without deadlines, and how
soon the master names it.

Peers hold a float32 model of ``--mib`` MiB and run DiLoCo with one inner step per outer step,
each preceded by ``--compute`` seconds of "inner steps" (a sleep: a GPU's work, which leaves the
host's cores to shoal). Three runs, one after the other in one invocation, on one master each:

- ``even``: every peer computes ``--compute`` s: the pace without the straggler;
- ``slow``: the last peer computes ``--slowdown`` times as long, no deadline: every outer step
  waits for it; peer 0 polls the master's ``/status`` after each outer step and records the
  first at which it names the slow peer a straggler;
- ``deadline``: the same slow peer, ``DiLoCo(deadline=--deadline)``: the others average without
  it when it is late, it skips ahead and its work counts when it makes one in time.

``--slow-link RATE`` also caps the slow peer's paths to every other host at RATE (a congested
link; lab only). Prints, per run, the steady peers' median outer step (the time from one outer
step's end to the next's: compute and communication) and its ratio to ``even``, the outer steps
the slow peer took part in, and when it was named.

    python bench/stragglers.py --peers 4 --mib 4 --compute 0.5
    python bench/stragglers.py --lab two-sites --peers 4 --mib 64 --compute 3 --deadline 0.3
    python bench/stragglers.py --lab two-sites --peers 4 --mib 64 --compute 3 --slowdown 1 --slow-link 250mbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request

import shoal

HTTP_PORT = 48149


def worker(master: str, status: str | None, index: int, mode: str, args: argparse.Namespace) -> None:
    import torch
    from shoal.torch import DiLoCo

    torch.set_num_threads(1)  # each peer its own core, as on its own machine
    comm = shoal.Communicator(master, timeout=300)
    comm.connect(timeout=120, min_world_size=args.peers)
    weight = torch.nn.Parameter(torch.zeros(args.mib << 18))
    deadline = args.deadline if mode == "deadline" else None
    diloco = DiLoCo(comm, [weight], inner_steps=1, outer_lr=0.7, outer_momentum=0.0, deadline=deadline)
    diloco.join()
    slow = index == args.peers - 1 and mode != "even"
    compute = args.compute * (args.slowdown if slow else 1.0)
    steps, named, taken_part = [], None, 0
    last = time.perf_counter()
    while diloco.outer_steps < args.steps:
        with torch.no_grad():
            weight.add_(0.001 * (index + 1))
        time.sleep(compute)
        diloco.step()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        taken_part += deadline is None or comm.rank in diloco.last_included
        if status is not None and named is None:
            with urllib.request.urlopen(f"http://{status}/status", timeout=10) as r:
                if json.load(r).get("stragglers"):
                    named = diloco.outer_steps
    diloco.finish()
    print(json.dumps({"index": index, "slow": slow, "steps": steps[1:], "outer": diloco.outer_steps,
                      "taken_part": taken_part, "named": named}), flush=True)


def run(args: argparse.Namespace, mode: str) -> list[dict]:
    """One run of ``mode``: a master and ``--peers`` peer processes; their reports."""
    argv = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
    if args.lab is None:
        with shoal.Master("127.0.0.1:0", http_addr="127.0.0.1:0") as master:
            procs = [subprocess.Popen([*argv, "--worker", master.address, "--status", master.http_address or "",
                                       "--index", str(i)], stdout=subprocess.PIPE, text=True)
                     for i in range(args.peers)]
            outs = [p.communicate(timeout=1800)[0] for p in procs]
    else:
        from shoal.lab import PROFILES, Lab

        with Lab.up(PROFILES[args.lab], name="bench-strag", subnet="10.211.0.0/24", ttl=2400,
                    **({"rate": args.rate} if args.rate else {})) as lab:
            hosts = [lab.hosts[i % len(lab.hosts)] for i in range(args.peers)]
            if args.slow_link:
                lab.fault("slow", hosts[-1], rate=args.slow_link)
            with lab.master(hosts[0], http_port=HTTP_PORT) as master:
                status = f"{lab.address(hosts[0])}:{HTTP_PORT}"
                procs = [lab.popen(h, [*argv, "--worker", master, "--status", status, "--index", str(i)],
                                   stdout=subprocess.PIPE, text=True) for i, h in enumerate(hosts)]
                outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{mode}: a peer failed: {[p.returncode for p in procs]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="outer steps per run")
    parser.add_argument("--compute", type=float, default=2.0, help="seconds of inner steps per outer step")
    parser.add_argument("--slowdown", type=float, default=2.0, help="the slow peer's compute, times --compute")
    parser.add_argument("--deadline", type=float, default=0.3, help="seconds, for the deadline run")
    parser.add_argument("--slow-link", help="cap the slow peer's links at this rate, e.g. 250mbit (lab only)")
    parser.add_argument("--lab", help="a lab profile: master and peers on its hosts")
    parser.add_argument("--rate", help="the lab's link cap, e.g. 100mbit")
    parser.add_argument("--runs", default="even,slow,deadline", help="which runs, in order")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--status", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.status or None, args.index, args.mode, args)
    if args.slow_link and not args.lab:
        raise SystemExit("--slow-link needs --lab")
    where = f"lab {args.lab}" + (f" at {args.rate}" if args.rate else "") if args.lab else "loopback"
    print(f"{where}, {args.peers} peers, {args.mib} MiB, compute {args.compute:g} s, the slow peer "
          f"{args.slowdown:g}x" + (f" behind a {args.slow_link} link" if args.slow_link else "")
          + f"; deadline {args.deadline:g} s", flush=True)
    base = None
    for mode in args.runs.split(","):
        reports = run(args, mode)
        steady = [s for r in reports if not r["slow"] for s in r["steps"]]
        median = statistics.median(steady)
        base = median if mode == "even" else base
        slow = next((r for r in reports if r["slow"]), None)
        named = next((r["named"] for r in reports if r["index"] == 0), None)
        line = f"{mode:>8}: steady peers' outer step {median:.3f} s"
        if base is not None and mode != "even":
            line += f" ({median / base:.2f}x even)"
        if slow is not None:
            line += f"; the slow peer took part in {slow['taken_part']} of {slow['outer']} outer steps"
            line += f", named a straggler at outer step {named}" if named is not None else ", not named"
        print(line, flush=True)


if __name__ == "__main__":
    main()
