"""DDP step time on torch.distributed's shoal backend and on Gloo, side by side in one run.

    python bench/torch_ddp.py --peers 2 4 --steps 20

The model: six 2048x2048 linear layers with ReLUs between (25.2M float32 parameters, 100 MB of
gradients per step in DDP's default 25 MB buckets); each process takes a batch of 8. The time
of a step is forward, backward (DDP's all-reduces overlapping it) and the optimizer's step; the
table gives the median over the timed steps of the slowest process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

WIDTH, LAYERS = 2048, 6


def _worker(backend: str, rank: int, world: int, port: int, steps: int) -> None:
    import shoal.torch  # noqa: F401 - registers the backend
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers: list = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, WIDTH)
    times = []
    for step in range(steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step >= 3:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "params": sum(p.numel() for p in model.parameters())}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run(backend: str, world: int, steps: int) -> tuple[float, int]:
    """The median step time (s) of the slowest process, and the parameter count."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", backend, str(rank), str(world),
                               str(port), str(steps)], stdout=subprocess.PIPE, text=True)
             for rank in range(world)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    slowest = [max(ts) for ts in zip(*(o["times"] for o in outs))]
    return statistics.median(slowest), outs[0]["params"]


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        backend, rank, world, port, steps = sys.argv[2], *map(int, sys.argv[3:7])
        return _worker(backend, rank, world, port, steps)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for world in args.peers:
        ours, params = run("shoal", world, args.steps)
        theirs, _ = run("gloo", world, args.steps)
        print(f"DDP, {params / 1e6:.1f}M parameters, {world} processes: step {ours * 1e3:.1f} ms on shoal, "
              f"{theirs * 1e3:.1f} ms on gloo (gloo / shoal x{theirs / ours:.2f})", flush=True)


if __name__ == "__main__":
    main()
