"""``shoal bench``: an nccl-tests style table of a collective's time and bandwidth over a size sweep.

It starts a master (or joins ``--master``) and ``--peers`` local peer processes, which join one
by one, then all-reduce every size for a fixed number of iterations. For each iteration the time
that counts is the slowest peer's; the table gives its median and p99, the algorithm bandwidth
(bytes / time) and the bus bandwidth, nccl-tests' measure of what each link carries: algbw times
2 (n - 1) / n for all_reduce, (n - 1) / n for all_gather and reduce_scatter (whose size is the
whole of ``world`` blocks: the output, respectively the input), 1 for broadcast and sendrecv
(each peer sends the size to the next rank while it receives as much from the previous one, with
tagged ``isend``/``recv``). ``--op`` picks the operation (default all_reduce), ``--reduction`` the
operator.
With ``--in-flight N`` each iteration starts N all-reduces of the size at once
(``all_reduce_async``) and waits for all of them: the time is the batch's, the bandwidths count
all N buffers. ``--algorithm`` forces ``ring`` or ``oneshot`` (default: chosen per size, as
``SHOAL_ALGO``); the table names the algorithm that ran.

The iteration policy and the table live here so that other implementations (``bench/gloo.py``)
are measured exactly the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

DEFAULT_SIZES = "4K,64K,1M,16M,64M,256M"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# Each size runs for about this many bytes, within the iteration bounds below.
_BUDGET_BYTES = 2 << 30
_MIN_ITERS, _MAX_ITERS = 8, 1000
# Bus bandwidth over algorithm bandwidth, per collective, for n peers (nccl-tests' factors).
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
REDUCTIONS = ("sum", "avg", "prod", "min", "max")


def parse_sizes(spec: str) -> list[int]:
    """``"4K,1M"`` -> ``[4096, 1048576]``."""
    sizes = []
    for part in spec.split(","):
        part = part.strip().upper().removesuffix("B")
        unit = part[-1] if part and part[-1] in _UNITS else ""
        number = part[: -1] if unit else part
        if not number.isdigit() or int(number) <= 0:
            raise argparse.ArgumentTypeError(f"bad size {part!r}: expected e.g. 4K, 64M, 1G")
        sizes.append(int(number) * _UNITS[unit])
    return sizes


def iterations(size_bytes: int, max_iters: int = _MAX_ITERS) -> tuple[int, int]:
    """(warm-up, timed) iterations for a size; the same on every peer. ``max_iters`` bounds
    the timed ones (on a WAN a small all-reduce takes many milliseconds)."""
    timed = min(max_iters, max(_MIN_ITERS, min(_MAX_ITERS, _BUDGET_BYTES // max(size_bytes, 1))))
    return min(5, timed), timed


def run_loop(
    all_reduce: Callable[[list[np.ndarray]], object], sizes: Sequence[int], dtype: str, out=sys.stdout,
    max_iters: int = _MAX_ITERS, in_flight: int = 1,
) -> None:
    """The worker side: for each size, warm up, time each iteration (``all_reduce`` of
    ``in_flight`` buffers at once, which may return the name of the algorithm that ran), print
    one JSON line."""
    np_dtype = np.dtype(dtype)
    for size in sizes:
        count = max(1, size // np_dtype.itemsize)
        xs = [np.ones(count, dtype=np_dtype) for _ in range(in_flight)]
        warm, timed = iterations(size * in_flight, max_iters)
        algorithm = None
        for _ in range(warm):
            algorithm = all_reduce(xs)
        times = []
        for _ in range(timed):
            t0 = time.perf_counter()
            all_reduce(xs)
            times.append(time.perf_counter() - t0)
        line = {"size": count * np_dtype.itemsize, "count": count, "in_flight": in_flight, "times": times}
        if isinstance(algorithm, str):
            line["algorithm"] = algorithm
        print(json.dumps(line), file=out, flush=True)


def summarize(per_peer: Sequence[Sequence[dict]], peers: int, collective: str = "all_reduce") -> list[dict]:
    """Combine every peer's JSON lines into one row per size."""
    rows = []
    for results in zip(*per_peer):
        size = results[0]["size"]
        in_flight = results[0].get("in_flight", 1)
        # An iteration ends when its slowest peer is done.
        slowest = [max(ts) for ts in zip(*(r["times"] for r in results))]
        median = statistics.median(slowest)
        p99 = float(np.percentile(slowest, 99))
        algbw = size * in_flight / median / 1e9
        op = collective if in_flight == 1 else f"{collective}x{in_flight}"
        algorithm = results[0].get("algorithm")
        rows.append(
            {
                "op": f"{op}/{algorithm}" if algorithm else op,
                "size": size,
                "count": results[0]["count"],
                "peers": peers,
                "iters": len(slowest),
                "time_us": median * 1e6,
                "p99_us": p99 * 1e6,
                "algbw_gbs": algbw,
                "busbw_gbs": algbw * BUS_FACTOR.get(collective, lambda n: 1.0)(peers) if peers > 1 else 0.0,
            }
        )
    return rows


def compare(name: str, theirs: Callable[[int, str, str], list[dict]], ops: Sequence[str], sizes: str,
            description: str) -> None:
    """The command line of a side-by-side comparison (``bench/compare_*.py``): for each peer
    count and op, shoal's rows and ``theirs(peers, sizes, op)``, then the ratios; ``--json``
    also writes every row."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", default=sizes)
    parser.add_argument("--ops", nargs="+", default=list(ops), choices=list(ops))
    parser.add_argument("--json", help="also write all rows to this file")
    args = parser.parse_args()
    everything = []
    for peers in args.peers:
        for op in args.ops:
            ours = run(peers, args.sizes, op=op)
            other = theirs(peers, args.sizes, op)
            print(format_comparison(ours, other, op, peers, name), flush=True)
            everything.append({"peers": peers, "op": op, "shoal": ours, name: other})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


def format_comparison(ours: Sequence[dict], theirs: Sequence[dict], op: str, peers: int, name: str) -> str:
    """shoal's rows and another library's (``name``) for the same sizes, then their ratios."""
    lines = [format_table(ours, f"shoal {op}, {peers} peers"), format_table(theirs, f"{name} {op}, {peers} peers"),
             f"# ratios, {op}, {peers} peers: shoal busbw / {name} busbw, {name} time / shoal time "
             "(higher is better for shoal)"]
    for a, b in zip(ours, theirs):
        lines.append(f"  {a['size']:>11} B  busbw x{a['busbw_gbs'] / max(b['busbw_gbs'], 1e-12):5.2f}  "
                     f"p50 x{b['time_us'] / a['time_us']:5.2f}  shoal p99/p50 {a['p99_us'] / a['time_us']:4.2f}")
    return "\n".join(lines) + "\n"


def format_table(rows: Iterable[dict], title: str) -> str:
    lines = [
        f"# {title}",
        f"# {'op':>22} {'size(B)':>11} {'count':>10} {'iters':>6} {'time(us)':>10} {'p99(us)':>10} "
        f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}",
    ]
    for r in rows:
        lines.append(
            f"  {r['op']:>22} {r['size']:>11} {r['count']:>10} {r['iters']:>6} {r['time_us']:>10.1f} "
            f"{r['p99_us']:>10.1f} {r['algbw_gbs']:>12.3f} {r['busbw_gbs']:>12.3f}"
        )
    return "\n".join(lines)


def spawn_workers(argv_for: Callable[[int], list[str]], peers: int, stagger: float = 0.0) -> list[list[dict]]:
    """Runs ``peers`` worker processes, ``stagger`` seconds apart (so that they join, and stand
    in the ring, in order), and returns each one's JSON lines.

    Output goes to files, not pipes: a worker blocked on a full pipe would stall the collective
    every other worker is in.
    """
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        files = [open(os.path.join(tmp, f"worker{i}.jsonl"), "w+") for i in range(peers)]
        procs = []
        for i, f in enumerate(files):
            procs.append(subprocess.Popen(argv_for(i), stdout=f, text=True))
            time.sleep(stagger)
        codes = [p.wait() for p in procs]
        outputs = []
        for f in files:
            f.seek(0)
            outputs.append([json.loads(line) for line in f if line.startswith("{")])
            f.close()
    if any(codes):
        raise SystemExit(f"a benchmark worker failed (exit codes {codes}; see its error above)")
    return outputs


def _worker(args: argparse.Namespace) -> None:
    import shoal

    comm = shoal.Communicator(args.master, connections=args.connections, chunk_bytes=args.chunk_bytes)
    comm.connect(timeout=120)
    # Admit newcomers until the whole local group is in.
    while comm.group_world_size < args.peers:
        if comm.peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.01)
    if args.optimize:
        comm.optimize_topology()
    world = comm.group_world_size
    # The other buffer of an all_gather (its input) or reduce_scatter (its output), per buffer.
    blocks: dict[int, np.ndarray] = {}
    received: dict[int, np.ndarray] = {}

    def block_of(x: np.ndarray) -> np.ndarray:
        # By length: an array's id comes back once it is freed. Made once, not per iteration
        # (setdefault's default would be: an allocation timed with every call).
        if len(x) not in blocks:
            blocks[len(x)] = np.ones(len(x) // world, x.dtype)
        return blocks[len(x)]

    q = None if args.quantization in (None, "none") else args.quantization

    def batch(xs: list[np.ndarray]) -> str:
        if args.op == "all_gather":
            return comm.all_gather(xs[0], block_of(xs[0]), quantization=q).algorithm
        if args.op == "reduce_scatter":
            return comm.reduce_scatter(block_of(xs[0]), xs[0], op=args.reduction, quantization=q).algorithm
        if args.op == "sendrecv":
            rank = comm.rank
            if len(xs[0]) not in received:
                received[len(xs[0])] = np.ones_like(xs[0])
            into = received[len(xs[0])]
            work = comm.isend(xs[0], peer=(rank + 1) % world)
            comm.recv(into, peer=(rank - 1) % world)
            return work.wait().algorithm
        if args.op == "broadcast":
            return comm.broadcast(xs[0], root=0, algorithm=args.algorithm).algorithm
        if len(xs) == 1:
            return comm.all_reduce(xs[0], op=args.reduction, algorithm=args.algorithm, quantization=q).algorithm
        works = [comm.all_reduce_async(x, op=args.reduction, tag=i, algorithm=args.algorithm, quantization=q)
                 for i, x in enumerate(xs)]
        return [work.wait() for work in works][-1].algorithm

    sizes = parse_sizes(args.sizes)
    if args.op in ("all_gather", "reduce_scatter"):
        # Whole blocks: a multiple of the world's size in elements.
        item = np.dtype(args.dtype).itemsize
        sizes = [max(1, size // item // world) * world * item for size in sizes]
    run_loop(batch, sizes, args.dtype, max_iters=args.max_iters, in_flight=args.in_flight)
    # Nobody leaves while another still moves data: a member leaving replaces the topology, which
    # fails every transfer still in flight (sendrecv has no collective to hold the peers in step).
    comm.barrier()
    comm.close()


def run(
    peers: int,
    sizes: str,
    *,
    dtype: str = "float32",
    op: str = "all_reduce",
    reduction: str = "sum",
    master_addr: Optional[str] = None,
    connections: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    lab: Optional[str] = None,
    hosts: Optional[Sequence[str]] = None,
    max_iters: int = _MAX_ITERS,
    in_flight: int = 1,
    algorithm: Optional[str] = None,
    optimize: bool = False,
    quantization: Optional[str] = None,
    tls: bool = False,
) -> list[dict]:
    """Runs the benchmark with ``peers`` worker processes and returns its rows. Starts a master
    unless ``master_addr`` is given. With ``lab`` (a lab that is up, see ``shoal lab``), peer i
    runs in lab host ``hosts[i % len(hosts)]`` (default: all the lab's hosts) and the master in
    the first of them. With ``tls``, every connection is under TLS, with certificates made for
    the run (each host's for its address)."""
    import shoal

    from . import _native
    from .lab import Lab

    the_lab = Lab(lab) if lab is not None else None
    places = list(hosts or the_lab.hosts) if the_lab else []

    def address(i: int) -> str:
        return the_lab.address(places[i % len(places)]) if the_lab else "127.0.0.1"

    with contextlib.ExitStack() as stack:
        certs: dict[str, dict[str, str]] = {}
        if tls:
            out = stack.enter_context(tempfile.TemporaryDirectory(prefix="shoal-bench-certs-"))
            ca, _, made = _native.make_certs(out, sorted({address(i) for i in range(max(peers, 1))}))
            certs = {host: {"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(ca)} for host, cert, key in made}

        def place(i: int, argv: list[str]) -> list[str]:
            if tls:
                argv = ["env", *(f"SHOAL_{k.upper()}={v}" for k, v in certs[address(i)].items()), *argv]
            return the_lab.argv(places[i % len(places)], argv) if the_lab else argv

        if the_lab and master_addr is None:
            master_addr = stack.enter_context(the_lab.master(places[0], tls=certs.get(address(0))))
        if master_addr is None:
            master = stack.enter_context(shoal.Master("127.0.0.1:0", **certs.get("127.0.0.1", {})))
            master_addr = master.address
        argv = [sys.executable, "-m", "shoal.bench", "--worker", "--master", master_addr, "--sizes", sizes]
        argv += ["--dtype", dtype, "--op", op, "--reduction", reduction, "--peers", str(peers)]
        argv += ["--max-iters", str(max_iters)]
        argv += ["--in-flight", str(in_flight)]
        if algorithm is not None:
            argv += ["--algorithm", algorithm]
        if optimize:
            argv += ["--optimize"]
        if quantization is not None:
            argv += ["--quantization", quantization]
        if connections is not None:
            argv += ["--connections", str(connections)]
        if chunk_bytes is not None:
            argv += ["--chunk-bytes", str(chunk_bytes)]
        # In a lab, the hosts' order is the ring's (until optimize_topology re-orders it).
        outputs = spawn_workers(lambda i: place(i, argv), peers, stagger=0.3 if the_lab else 0.0)
    rows = summarize(outputs, peers, op)
    for row in rows:
        row["quantization"] = quantization or "none"
        row["tls"] = tls
    return rows


def accuracy(elements: int = 1 << 22, seed: int = 0) -> list[dict]:
    """How far each quantization's decoded values lie from the originals, on normally
    distributed data and on heavy-tailed data (Student's t, 2 degrees of freedom): one row per
    format and block size, as one peer's encoding of its tensor (what the first hop of an
    all-reduce loses)."""
    from . import _native

    rng = np.random.default_rng(seed)
    data = {"normal": rng.standard_normal(elements).astype(np.float32),
            "heavy": rng.standard_t(2, elements).astype(np.float32)}
    cases = [("fp16", None), ("bf16", None)] + [(q, b) for q in ("int8", "int4") for b in (32, 64, 128, 256, 1024)]
    rows = []
    for q, block in cases:
        for name, x in data.items():
            y = x.copy()
            encoded = _native.quantize_bytes(y.view(np.uint8), "f32", (q, block))
            err = y.astype(np.float64) - x
            rows.append({"quantization": q, "block": block or "-", "data": name, "ratio": x.nbytes / encoded,
                         "mean": float(err.mean()), "mean_abs": float(np.abs(err).mean()),
                         "max": float(np.abs(err).max()), "rms": float(np.sqrt((err ** 2).mean()))})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="shoal bench", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4, help="local peer processes (default 4)")
    parser.add_argument("--master", help="join this master instead of starting one")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"bytes per all-reduce (default {DEFAULT_SIZES})")
    parser.add_argument("--dtype", default="float32", help="numpy dtype (default float32)")
    parser.add_argument("--op", default="all_reduce",
                        help=f"collective: {', '.join(BUS_FACTOR)} (default all_reduce)")
    parser.add_argument("--reduction", default="sum", choices=REDUCTIONS, help="reduction operator (default sum)")
    parser.add_argument("--connections", type=int, default=None, help="TCP connections per peer pair")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="ring pipeline chunk")
    parser.add_argument("--max-iters", type=int, default=_MAX_ITERS,
                        help=f"at most this many timed iterations per size (default {_MAX_ITERS})")
    parser.add_argument("--lab", help="run the peers (and the master) in the hosts of this lab (shoal lab up)")
    parser.add_argument("--hosts", help="comma-separated lab hosts for the peers, in ring order (default: all)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--in-flight", type=int, default=1,
                        help="all-reduces of each size started at once per iteration (default 1)")
    parser.add_argument("--algorithm", default=None,
                        choices=["auto", "ring", "oneshot", "twoshot", "hierarchical", "doubling", "twolevel"],
                        help="all-reduce algorithm (default: chosen per size)")
    parser.add_argument("--optimize", action="store_true",
                        help="order the ring by measured links (optimize_topology) before timing")
    parser.add_argument("--quantization", nargs="+", default=None,
                        choices=["none", "fp16", "bf16", "int8", "int4"],
                        help="quantize the chunks (several: each in turn, with each one's time over the first's)")
    parser.add_argument("--accuracy", action="store_true",
                        help="print each quantization's error on normal and heavy-tailed data, and exit")
    parser.add_argument("--tls", nargs="+", default=None, choices=["off", "on"],
                        help="every connection in plaintext or under TLS (both: each in turn, with TLS's throughput "
                             "over plaintext's)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    parse_sizes(args.sizes)
    if args.worker:
        args.quantization = args.quantization[0] if args.quantization else None
        return _worker(args)
    if args.accuracy:
        rows = accuracy()
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(f"{'format':>6} {'block':>5} {'data':>6} {'ratio':>5} {'mean':>10} {'mean |e|':>9} {'max |e|':>9}")
            for r in rows:
                print(f"{r['quantization']:>6} {r['block']:>5} {r['data']:>6} {r['ratio']:>5.2f} {r['mean']:>10.2e} "
                      f"{r['mean_abs']:>9.2e} {r['max']:>9.2e}")
        return None
    if args.op in REDUCTIONS:  # the flag's earlier meaning: all_reduce with that operator
        args.op, args.reduction = "all_reduce", args.op
    if args.op not in BUS_FACTOR:
        parser.error(f"--op {args.op}: expected one of {', '.join(BUS_FACTOR)}")
    if args.peers < 1 or args.max_iters < 1 or args.in_flight < 1:
        parser.error("--peers, --max-iters and --in-flight must be at least 1")
    if args.in_flight > 1 and args.op != "all_reduce":
        parser.error("--in-flight runs all_reduce_async: only with --op all_reduce")

    if args.tls and args.quantization and len(args.tls) * len(args.quantization) > 1:
        parser.error("compare either TLS modes or quantizations, not both at once")

    rows = []
    for tls in args.tls or ["off"]:
        for q in args.quantization or [None]:
            rows += run(args.peers, args.sizes, dtype=args.dtype, op=args.op, reduction=args.reduction,
                        master_addr=args.master, connections=args.connections, chunk_bytes=args.chunk_bytes,
                        lab=args.lab, hosts=args.hosts.split(",") if args.hosts else None, max_iters=args.max_iters,
                        in_flight=args.in_flight, algorithm=args.algorithm, optimize=args.optimize,
                        quantization=None if q == "none" else q, tls=tls == "on")
    where = args.master or (f"in lab {args.lab}" if args.lab else "local")
    if args.json:
        print(json.dumps(rows, indent=1))
        return None
    title = f"shoal {args.op}, {args.peers} peers, {args.dtype} {args.reduction}, master {where}"
    if args.tls and len(args.tls) > 1:
        for tls in (False, True):
            print(format_table([r for r in rows if r["tls"] == tls], f"{title}, {'TLS' if tls else 'plaintext'}"))
        plain = {r["size"]: r["time_us"] for r in rows if not r["tls"]}
        for r in rows:
            if r["tls"]:
                print(f"TLS at {r['size']} B: {plain[r['size']] / r['time_us']:.2f}x the throughput of plaintext")
        return None
    if not args.quantization:
        print(format_table(rows, title))
        return None
    for q in args.quantization:
        print(format_table([r for r in rows if r["quantization"] == q], f"{title}, quantization {q}"))
    first = {r["size"]: r["time_us"] for r in rows if r["quantization"] == args.quantization[0]}
    for r in rows:
        if r["quantization"] != args.quantization[0]:
            print(f"{r['quantization']} at {r['size']} B: {first[r['size']] / r['time_us']:.2f}x the speed of "
                  f"{args.quantization[0]}")
    return None


if __name__ == "__main__":
    main()
