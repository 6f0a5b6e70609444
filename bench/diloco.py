"""What DiLoCo's outer step costs in communication next to a bare all-reduce of the same bytes.

Peers hold a float32 model of ``--mib`` MiB; each round, every peer times (a) a bare
``all_reduce(avg)`` of a buffer of the model's size and (b) ``DiLoCo.outer_step()`` (the sync of
the anchor and outer momentum, which hashes both, then the all-reduce of the pseudo-gradients and
the outer update). Prints the medians of peer 0 and their ratio.

    python bench/diloco.py --peers 3 --mib 16 --rounds 10
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import shoal


def worker(master: str, peers: int, mib: int, rounds: int) -> None:
    import torch
    from shoal.torch import DiLoCo

    comm = shoal.Communicator(master, timeout=120)
    comm.connect(timeout=60)
    while comm.group_world_size < peers:
        if comm.peers_pending():
            comm.update_topology()
    n = mib << 18
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(n))
    diloco = DiLoCo(comm, [weight], inner_steps=1)
    diloco.join()
    bare, outer = [], []
    buffer = torch.ones(n)
    for _ in range(rounds):
        t = time.perf_counter()
        comm.all_reduce(buffer, op="avg")
        bare.append(time.perf_counter() - t)
        with torch.no_grad():
            weight.add_(0.001)
        t = time.perf_counter()
        diloco.outer_step()
        outer.append(time.perf_counter() - t)
    if comm.rank == 0:
        b, o = statistics.median(bare), statistics.median(outer)
        print(f"{peers} peers, {mib} MiB: bare all_reduce {b * 1e3:.1f} ms, DiLoCo outer step {o * 1e3:.1f} ms, "
              f"ratio {o / b:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.peers, args.mib, args.rounds)
    with shoal.Master("127.0.0.1:0") as master:
        cmd = [sys.executable, __file__, "--worker", master.address, "--peers", str(args.peers),
               "--mib", str(args.mib), "--rounds", str(args.rounds)]
        procs = [subprocess.Popen(cmd) for _ in range(args.peers)]
        if any(p.wait(timeout=600) != 0 for p in procs):
            raise SystemExit("a peer failed")


if __name__ == "__main__":
    main()
