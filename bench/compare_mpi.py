"""shoal and Open MPI (shared-memory transport, ``vader``), side by side in one run, with ratios.

    python bench/compare_mpi.py --peers 2 4 --sizes 64M,256M --ops all_reduce sendrecv

Installs Open MPI from Debian's packages when ``mpicc`` is missing (root and apt), builds
``bench/mpi_bench.c`` into ``~/.cache/shoal/bin``, and runs it with ``mpirun --mca btl
self,vader``: processes on this host, as shoal's peers are. Both sides run the same loop (see
``mpi_bench.c``) and are summarized by the same code (``shoal.bench.summarize``). The machine is
shared and noisy: trust the ratios more than the absolute figures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from shoal import bench

HERE = Path(__file__).resolve().parent
BINARY = Path(os.path.expanduser("~/.cache/shoal/bin/shoal-mpi-bench"))
OPS = ("all_reduce", "sendrecv")


def ensure_mpi() -> Path:
    """The benchmark binary, installing Open MPI and building it first if needed."""
    if shutil.which("mpicc") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            sys.exit("Open MPI is missing: install openmpi-bin and libopenmpi-dev (needs root and apt)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", "openmpi-bin", "libopenmpi-dev"], check=True, env=env,
                       stdout=subprocess.DEVNULL)
    source = HERE / "mpi_bench.c"
    if not BINARY.exists() or BINARY.stat().st_mtime < source.stat().st_mtime:
        BINARY.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mpicc", "-O2", "-o", str(BINARY), str(source)], check=True)
    return BINARY


def run_mpi(binary: Path, peers: int, sizes: str, op: str) -> list[dict]:
    """Open MPI's rows for ``op`` over ``sizes``, as ``shoal.bench.run`` returns shoal's."""
    specs = []
    for size in bench.parse_sizes(sizes):
        warm, timed = bench.iterations(size)
        specs.append(f"{size}:{warm}:{timed}")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    with tempfile.TemporaryDirectory() as out:
        cmd = ["mpirun", "-np", str(peers), "--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,vader",
               "--mca", "pml", "ob1", str(binary), op, out, *specs]
        subprocess.run(cmd, check=True, env=env, timeout=1800)
        per_peer = [[json.loads(line) for line in (Path(out) / f"rank{r}.jsonl").read_text().splitlines()]
                    for r in range(peers)]
    return bench.summarize(per_peer, peers, op)


def main() -> None:
    # Open MPI is installed and the binary built at the first comparison, not for --help.
    bench.compare("mpi", lambda peers, sizes, op: run_mpi(ensure_mpi(), peers, sizes, op), OPS, "64M,256M",
                  __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
