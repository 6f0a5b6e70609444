"""The same benchmark as ``shoal bench``, run by torch.distributed's Gloo backend (or, with
``--backend shoal``, by torch.distributed on shoal's backend).

    python bench/gloo.py --peers 4 --sizes 4K,64M,256M --op all_reduce

``--op`` is ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast`` or ``sendrecv``, with
the sizes meaning what they mean to ``shoal bench`` (the whole output of an all-gather, the whole
input of a reduce-scatter; what each peer sends to the next for sendrecv, with ``isend`` and
``recv``), or one of torch's own: ``reduce`` (to rank 0), ``gather`` and ``scatter`` (of the
whole size, at rank 0), ``all_to_all`` (``all_to_all_single`` of the whole size), ``barrier``.

Iteration counts, timing and the table come from ``shoal.bench``, so the two are measured the
same way. Needs torch (``pip install torch``; scripts/env installs it).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from shoal.bench import (
    BUS_FACTOR,
    DEFAULT_SIZES,
    format_table,
    parse_sizes,
    run_loop,
    spawn_workers,
    summarize,
)

# torch.distributed's operations that shoal's API has no verb of its own for (the sizes, as for
# all_gather: the whole of the world's blocks; a barrier moves none).
TORCH_ONLY = ("reduce", "gather", "scatter", "all_to_all", "barrier")


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.backend == "shoal":
        import shoal.torch  # noqa: F401 - registers the backend
    dist.init_process_group(
        args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.peers
    )
    if args.floor:
        # What no backend can go below: shoal's own all-reduce of the array, then torch's
        # dispatch of dist.all_reduce to its "fake" backend, which returns at once.
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 - registers "fake"

        fake = dist.new_group(backend="fake")
        world_group = dist.group.WORLD._get_backend(torch.device("cpu")).communicator
        op = args.reduction

        def floor(xs: list) -> str:
            world_group.all_reduce(xs[0], op=op)
            dist.all_reduce(torch.from_numpy(xs[0]), group=fake)
            return ""

        run_loop(floor, parse_sizes(args.sizes), args.dtype)
        dist.destroy_process_group()
        return
    reduction = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}[args.reduction]
    world, rank = args.peers, args.rank
    blocks: dict[tuple[int, int], torch.Tensor] = {}

    def block_of(t: torch.Tensor, rows: int) -> torch.Tensor:
        # By shape: an object's id comes back once it is freed. Made once, not per iteration
        # (setdefault's default would be: an allocation and a fill timed with every call).
        if (len(t), rows) not in blocks:
            blocks[(len(t), rows)] = torch.ones(rows, dtype=t.dtype)
        return blocks[(len(t), rows)]

    def batch(xs: list) -> str:
        t = torch.from_numpy(xs[0])
        if args.op == "all_gather":
            dist.all_gather_into_tensor(t, block_of(t, len(t) // world))
        elif args.op == "reduce_scatter":
            dist.reduce_scatter_tensor(block_of(t, len(t) // world), t, op=reduction)
        elif args.op == "broadcast":
            dist.broadcast(t, src=0)
        elif args.op == "sendrecv":
            work = dist.isend(t, dst=(rank + 1) % world)
            dist.recv(block_of(t, len(t)), src=(rank - 1) % world)
            work.wait()
        elif args.op == "reduce":
            dist.reduce(t, dst=0, op=reduction)
        elif args.op == "gather":
            dist.gather(block_of(t, len(t) // world), list(t.chunk(world)) if rank == 0 else None, dst=0)
        elif args.op == "scatter":
            dist.scatter(block_of(t, len(t) // world), list(t.chunk(world)) if rank == 0 else None, src=0)
        elif args.op == "all_to_all":
            dist.all_to_all_single(block_of(t, len(t)), t)
        elif args.op == "barrier":
            dist.barrier()
        else:
            dist.all_reduce(t, op=reduction)
        return ""

    sizes = parse_sizes(args.sizes)
    if args.op in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"):
        item = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
        sizes = [max(1, size // item // world) * world * item for size in sizes]
    run_loop(batch, sizes, args.dtype)
    dist.destroy_process_group()


def run(peers: int, sizes: str, dtype: str = "float32", op: str = "all_reduce", reduction: str = "sum",
        backend: str = "gloo", floor: bool = False) -> list[dict]:
    """Runs the benchmark of ``op`` on torch.distributed's ``backend`` and returns its rows;
    with ``floor`` (backend shoal, op all_reduce), the rows of the floor instead: shoal's
    all-reduce and torch's dispatch to a backend that does nothing, one after the other."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--peers", str(peers), "--sizes", sizes]
    argv += ["--dtype", dtype, "--op", op, "--reduction", reduction, "--port", str(port), "--backend", backend]
    argv += ["--floor"] if floor else []
    outputs = spawn_workers(lambda i: [*argv, "--rank", str(i)], peers)
    return summarize(outputs, peers, op)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--op", default="all_reduce", choices=[*BUS_FACTOR, *TORCH_ONLY])
    parser.add_argument("--reduction", default="sum", choices=["sum", "avg", "max"])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "shoal"])
    parser.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    rows = run(args.peers, args.sizes, args.dtype, args.op, args.reduction, args.backend)
    title = f"torch.distributed {args.backend} {args.op}, {args.peers} peers, {args.dtype} {args.reduction}"
    print(format_table(rows, title))


if __name__ == "__main__":
    main()
