"""What this machine's memory allows a collective on one host, measured now: the floor under
which no implementation of shoal's contract can go, to read ``shoal bench`` figures against.

    python bench/floors.py --peers 2 4 --sizes 64M,256M

It measures two rates, each with the processes working at once as peers do:

- **copy**: ``P`` processes each copying 64 MiB (large copies stream past the cache), in bytes
  read plus bytes written per second, over all of them;
- **cross-process read**: 2 processes each reading the other's 64 MiB with
  ``process_vm_readv(2)`` (shoal's single-copy send/recv), per direction.

From them, for an all-reduce of ``N`` bytes among ``P`` peers, the least memory traffic of any
algorithm that reads every other peer's memory directly, at no cost beyond the bytes (which
this machine has no way to do: it is a lower bound), per peer:

- read its input once (``N``), and save it for the restore a failed call needs (``N`` written:
  DESIGN's "buffers as they were before the call"; Gloo and MPI promise no such thing);
- reduce its ``1/P`` of the result: read the others' inputs for it (``(P-1) N / P``), write it
  (``N / P``); then gather the others' results (``(P-1) N / P`` read and as much written).

That is ``(3 + 2 (P-1)/P) N`` per peer with the restore and ``(2 + 2 (P-1)/P) N`` without; the
floor is ``P`` times it over the copy rate, and the bus bandwidth it allows is
``2 (P-1)/P N`` over the floor. A send/recv of ``N`` both ways at once cannot beat ``N`` over
the cross-process read rate.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import queue
import time

import numpy as np
from shoal.bench import parse_sizes

BLOCK = 64 << 20
PIECE = 2 << 20
ROUNDS = 8


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _copier(start, done) -> None:
    src, dst = np.ones(BLOCK, np.uint8), np.zeros(BLOCK, np.uint8)
    np.copyto(dst, src)
    start.wait()
    t = time.perf_counter()
    for _ in range(ROUNDS):
        np.copyto(dst, src)
    done.put(time.perf_counter() - t)


def copy_rate(procs: int) -> float:
    """Bytes read and written per second by ``procs`` processes copying at once."""
    start, done = mp.Barrier(procs), mp.Queue()
    workers = [mp.Process(target=_copier, args=(start, done)) for _ in range(procs)]
    for w in workers:
        w.start()
    slowest = _slowest(workers, done)
    return procs * ROUNDS * 2 * BLOCK / slowest


def _reader(me: int, addrs, start, done) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    read = libc.process_vm_readv
    read.restype = ctypes.c_ssize_t
    read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl(0x59616D61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)  # PR_SET_PTRACER_ANY, where Yama is on
    mine, into = np.ones(BLOCK, np.uint8), np.zeros(BLOCK, np.uint8)
    addrs[me] = (os.getpid(), mine.ctypes.data)
    start.wait()
    pid, remote = addrs[1 - me]
    local_iov, remote_iov = _IoVec(), _IoVec()
    t = None
    for round in range(ROUNDS + 1):
        if round == 1:
            t = time.perf_counter()
        for off in range(0, BLOCK, PIECE):
            local_iov.base, local_iov.len = into.ctypes.data + off, PIECE
            remote_iov.base, remote_iov.len = remote + off, PIECE
            n = read(pid, ctypes.addressof(local_iov), 1, ctypes.addressof(remote_iov), 1, 0)
            if n != PIECE:
                raise OSError(ctypes.get_errno(), "process_vm_readv")
    done.put(time.perf_counter() - t)
    start.wait()  # our buffer stays until the other has read it all


def cross_read_rate() -> float:
    """Bytes per second each of 2 processes reads out of the other, both at once."""
    manager = mp.Manager()
    addrs, start, done = manager.list([None, None]), mp.Barrier(2), mp.Queue()
    workers = [mp.Process(target=_reader, args=(i, addrs, start, done)) for i in range(2)]
    for w in workers:
        w.start()
    slowest = _slowest(workers, done)
    return ROUNDS * BLOCK / slowest


def _slowest(workers: list, done) -> float:
    """The longest time the workers put in ``done``; a worker that failed fails the run."""
    times = []
    while len(times) < len(workers):
        try:
            times.append(done.get(timeout=1))
        except queue.Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                raise SystemExit("a measuring process failed (its error is above)") from None
    for w in workers:
        w.join()
    return max(times)


def all_reduce_traffic(peers: int, size: int, restore: bool) -> float:
    """Least bytes of memory traffic of an all-reduce of ``size`` bytes over all peers."""
    return peers * ((3 if restore else 2) + 2 * (peers - 1) / peers) * size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("64M,256M"))
    args = parser.parse_args()
    mp.set_start_method("fork")
    print(f"# {os.cpu_count()} cores; large copies, all processes at once (read + written per second):")
    rates = {p: copy_rate(p) for p in sorted(set(args.peers))}
    for p, rate in rates.items():
        print(f"#   {p} processes: {rate / 1e9:.1f} GB/s")
    cross = cross_read_rate()
    print(f"# process_vm_readv, 2 processes each reading the other at once: {cross / 1e9:.2f} GB/s each way")
    print(f"{'op':>12} {'peers':>5} {'size(B)':>11} {'floor(ms)':>10} {'busbw max':>10} "
          f"{'no restore':>11} {'busbw max':>10}")
    for p in args.peers:
        for size in args.sizes:
            bus = 2 * (p - 1) / p * size
            with_restore = all_reduce_traffic(p, size, True) / rates[p]
            without = all_reduce_traffic(p, size, False) / rates[p]
            print(f"{'all_reduce':>12} {p:>5} {size:>11} {with_restore * 1e3:>10.1f} {bus / with_restore / 1e9:>10.2f} "
                  f"{without * 1e3:>11.1f} {bus / without / 1e9:>10.2f}")
    for size in args.sizes:
        t = size / cross
        print(f"{'sendrecv':>12} {2:>5} {size:>11} {t * 1e3:>10.1f} {size / t / 1e9:>10.2f}")


if __name__ == "__main__":
    main()
