"""torch.distributed on shoal's backend, side by side with shoal's own API and with Gloo.

    python bench/torch_backend.py --peers 2 4 --sizes 4K,1M,64M,256M

For each op and size: the time of ``dist.<op>`` on the ``shoal`` backend, of ``dist.<op>`` on
Gloo and, where shoal's API has the verb, of the same op through it, all measured by the same loop
(``shoal.bench``), in one run; then how the backend compares with Gloo (Gloo / backend: above 1,
the backend is faster) and what it adds to shoal's API (backend / native). For all_reduce also the
floor of any c10d backend: shoal's call, then torch's dispatch of ``dist.all_reduce`` to its
``fake`` backend (which returns at once), timed together: on this 2-core machine torch's dispatch
right after a large collective runs with cold caches and costs far more than in a loop of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gloo
from shoal import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", default="4K,1M,64M,256M")
    ops = [*bench.BUS_FACTOR, *gloo.TORCH_ONLY]
    parser.add_argument("--ops", nargs="+", default=ops, choices=ops)
    parser.add_argument("--json", help="also write all rows to this file")
    args = parser.parse_args()
    everything = []
    for peers in args.peers:
        for op in args.ops:
            sizes = "4" if op == "barrier" else args.sizes
            backend = gloo.run(peers, sizes, op=op, backend="shoal")
            native = bench.run(peers, sizes, op=op) if op in bench.BUS_FACTOR else [None] * len(backend)
            theirs = gloo.run(peers, sizes, op=op, backend="gloo")
            floor = gloo.run(peers, sizes, backend="shoal", floor=True) if op == "all_reduce" else [None] * len(backend)
            print(f"# {op}, {peers} peers: p50 time (us) of dist.{op} on shoal, shoal's API, dist.{op} on gloo")
            for b, n, g, f in zip(backend, native, theirs, floor):
                ours = f"native {n['time_us']:>10.1f}  backend/native x{b['time_us'] / n['time_us']:5.2f}" if n else \
                    f"{'(no verb of its own)':>44}"
                least = f"  floor {f['time_us']:>10.1f}  floor/native x{f['time_us'] / n['time_us']:5.2f}" if f else ""
                print(f"  {b['size']:>11} B  backend {b['time_us']:>10.1f}  gloo {g['time_us']:>10.1f}  "
                      f"gloo/backend x{g['time_us'] / b['time_us']:5.2f}  {ours}{least}", flush=True)
            everything.append({"peers": peers, "op": op, "backend": backend, "native": native, "gloo": theirs,
                               "floor": floor})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
