"""shoal and torch.distributed Gloo, side by side in one run, with ratios.

    python bench/compare_gloo.py --peers 2 4 --sizes 4K,64M,256M --ops all_reduce sendrecv

Every op of ``shoal bench --op`` by default (all_reduce, all_gather, reduce_scatter, broadcast,
sendrecv).

Both are measured by the same code (shoal.bench): same sizes, iteration counts and statistics.
The machine is shared and noisy: trust the ratios more than the absolute figures.
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
    parser.add_argument("--sizes", default="4K,64M,256M")
    parser.add_argument("--ops", nargs="+", default=list(bench.BUS_FACTOR), choices=list(bench.BUS_FACTOR))
    parser.add_argument("--json", help="also write all rows to this file")
    args = parser.parse_args()
    everything = []
    for peers in args.peers:
        for op in args.ops:
            ours = bench.run(peers, args.sizes, op=op)
            theirs = gloo.run(peers, args.sizes, op=op)
            print(bench.format_comparison(ours, theirs, op, peers, "gloo"), flush=True)
            everything.append({"peers": peers, "op": op, "shoal": ours, "gloo": theirs})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
