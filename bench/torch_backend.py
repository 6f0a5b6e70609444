"""torch.distributed on shoal's backend, side by side with shoal's own API and with Gloo.

    python bench/torch_backend.py --peers 2 4 --sizes 4K,1M,64M,256M

For each op and size: the time of ``dist.<op>`` on the ``shoal`` backend, of the same op through
shoal's API, and of ``dist.<op>`` on Gloo, all measured by the same loop (``shoal.bench``), in one
run; then what the backend adds (backend / native) and how it compares with Gloo (Gloo / backend:
above 1, the backend is faster).
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
    parser.add_argument("--ops", nargs="+", default=list(bench.BUS_FACTOR), choices=list(bench.BUS_FACTOR))
    parser.add_argument("--json", help="also write all rows to this file")
    args = parser.parse_args()
    everything = []
    for peers in args.peers:
        for op in args.ops:
            backend = gloo.run(peers, args.sizes, op=op, backend="shoal")
            native = bench.run(peers, args.sizes, op=op)
            theirs = gloo.run(peers, args.sizes, op=op, backend="gloo")
            print(f"# {op}, {peers} peers: p50 time (us) of dist.{op} on shoal, shoal's API, dist.{op} on gloo")
            for b, n, g in zip(backend, native, theirs):
                print(f"  {b['size']:>11} B  backend {b['time_us']:>10.1f}  native {n['time_us']:>10.1f}  "
                      f"gloo {g['time_us']:>10.1f}  backend/native x{b['time_us'] / n['time_us']:5.2f}  "
                      f"gloo/backend x{g['time_us'] / b['time_us']:5.2f}", flush=True)
            everything.append({"peers": peers, "op": op, "backend": backend, "native": native, "gloo": theirs})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
