"""shoal and torch.distributed Gloo, side by side in one run, with ratios.

    python bench/compare_gloo.py --peers 2 4 --sizes 4K,64M,256M --ops all_reduce sendrecv

Every op of ``shoal bench --op`` by default (all_reduce, all_gather, reduce_scatter, broadcast,
sendrecv).

Both are measured by the same code (shoal.bench): same sizes, iteration counts and statistics.
The machine is shared and noisy: trust the ratios more than the absolute figures.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gloo
from shoal import bench


def main() -> None:
    bench.compare("gloo", lambda peers, sizes, op: gloo.run(peers, sizes, op=op), list(bench.BUS_FACTOR),
                  "4K,64M,256M", __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
