"""The same all-reduce benchmark as ``shoal bench``, run by torch.distributed's Gloo backend.

    python bench/gloo.py --peers 4 --sizes 4K,64M,256M

Iteration counts, timing and the table come from ``shoal.bench``, so the two are measured the
same way. Needs torch (``pip install torch``; scripts/env installs it).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from shoal.bench import (
    DEFAULT_SIZES,
    format_table,
    parse_sizes,
    run_loop,
    spawn_workers,
    summarize,
)


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.peers
    )
    op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}[args.op]
    run_loop(lambda xs: dist.all_reduce(torch.from_numpy(xs[0]), op=op), parse_sizes(args.sizes), args.dtype)
    dist.destroy_process_group()


def run(peers: int, sizes: str, dtype: str = "float32", op: str = "sum") -> list[dict]:
    """Runs the benchmark and returns its rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--peers", str(peers), "--sizes", sizes]
    argv += ["--dtype", dtype, "--op", op, "--port", str(port)]
    outputs = spawn_workers(lambda i: [*argv, "--rank", str(i)], peers)
    return summarize(outputs, peers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--op", default="sum")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    rows = run(args.peers, args.sizes, args.dtype, args.op)
    print(format_table(rows, f"torch.distributed gloo all_reduce, {args.peers} peers, {args.dtype} {args.op}"))


if __name__ == "__main__":
    main()
