"""How shoal's costs grow with the number of peers: joins, votes, syncs, all-reduces, recovery, the master.

For each N in ``--peers``: a ``shoal master`` process and N peer processes on this machine. The
peers connect at once (the members admit the others with the README's loop), then each step runs
on every peer, timed there:

- ``connect()`` to accepted, for each peer; then ``peers_pending()`` and ``update_topology()`` with
  nobody pending;
- ``sync_shared_state()`` of ``--state-mib`` MiB with nothing to repair, then with one peer's state
  different (repaired from the others);
- an all-reduce of each of ``--sizes`` (float32 sum, the automatic algorithm), median of ``--iters``;
- one newcomer: ``update_topology()`` admitting it (and its own ``connect()``);
- SIGKILL of the newcomer while everyone all-reduces 4 KiB in a loop (``except PeerLostError:
  update_topology()``): from the kill to each survivor's first success without it.

The master's CPU time and memory come from ``/proc`` at each step's start and end, and over
``--rest`` seconds with every peer idle. ``--lab NAME`` runs the master and the peers in a lab's
hosts (``shoal lab up``: round trips between sites) instead of on loopback. ``--sim`` adds the simulator's large run (the shipped
master and peer machines, simulated time and network) at each of ``--sim-peers``: crash to the
topology without the crashed peer, a newcomer's join to the topology with it, and the master's
real time per event. Prints a table, writes ``growth.json`` and, with matplotlib, PNG plots into
``--out``. Every process inherits the caller's ``SHOAL_*`` settings: in a lab, set
``SHOAL_PROBE_BYTES=262144`` with ``--optimize`` (its probes grow to 64 MiB by default, 19 minutes
across 64 peers).

    python bench/growth.py --peers 2 4 8 16 32 64 --sim --big-max-peers 64 --out DIR   # PNGs as in docs/img
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import shoal
from shoal.lab import Lab

ROOT = Path(__file__).resolve().parent.parent


# Each master thread's CPU seconds when last seen, by (process, thread): a connection's thread
# ends with its peer, and its time must not leave the total with it.
THREAD_CPU: dict[tuple[int, int], float] = {}


def master_usage(pid: int) -> tuple[float, float]:
    """The master's CPU seconds so far (every thread's, to the nanosecond: ``/proc/*/stat``
    counts 10 ms ticks; a thread that ended counts what it had when last seen) and resident MiB."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            THREAD_CPU[pid, int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except OSError:  # a thread that ended
            pass
    cpu = sum(seconds for (p, _), seconds in THREAD_CPU.items() if p == pid)
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:")) / 1024
    return cpu, rss


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def votes(iters: int) -> int:
    """Votes in the votes step: `iters` of peers_pending, then update_topology a quarter as often."""
    return iters + max(3, iters // 4)


def step(index: int, name: str) -> None:
    """Tells the driver (through peer 0's output) that a step begins."""
    if index == 0:
        print(f"STEP {name}", flush=True)


def member(args: argparse.Namespace) -> None:
    """One of the N peers: every step, then its timings as one JSON line."""
    n, index = args.n, args.index
    out: dict = {}
    comm = shoal.Communicator(args.master, timeout=120)
    out["connect_s"] = timed(lambda: comm.connect(timeout=120))
    while comm.group_world_size < n:
        if comm.peers_pending():
            comm.update_topology()
    if args.optimize:
        comm.optimize_topology()
    comm.all_reduce(np.ones(1, np.float32))
    step(index, "votes")
    out["peers_pending_s"] = statistics.median(timed(comm.peers_pending) for _ in range(args.iters))
    out["update_topology_s"] = statistics.median(timed(comm.update_topology) for _ in range(votes(args.iters) - args.iters))
    step(index, "sync")
    elems = (args.state_mib << 20) // 4
    w = np.full(elems, 1.5, np.float32)
    state = shoal.SharedState({"w": w})
    comm.sync_shared_state(state)  # the first sync settles revisions
    state.revision += 1
    out["sync_s"] = timed(lambda: comm.sync_shared_state(state))
    state.revision += 1
    if index == n - 1:
        w[:] = 0.0  # this one differs: repaired from the others (with two, whichever the vote elects)
    out["sync_repair_s"] = timed(lambda: comm.sync_shared_state(state))
    step(index, "all_reduce")
    for size in args.sizes:
        x = np.ones(parse_size(size) // 4, np.float32)
        comm.all_reduce(x)
        took, algorithm = [], None
        for _ in range(args.iters if parse_size(size) <= 1 << 20 else max(3, args.iters // 10)):
            started = time.perf_counter()
            info = comm.all_reduce(x)
            took.append(time.perf_counter() - started)
            algorithm = info.algorithm
        out[f"all_reduce_{size}_s"] = statistics.median(took)
        out[f"all_reduce_{size}_algorithm"] = algorithm
    del x
    step(index, "rest")
    time.sleep(args.rest)
    comm.all_reduce(np.ones(1, np.float32))
    step(index, "admit")
    while not comm.peers_pending():
        time.sleep(0.02)
    out["admit_s"] = timed(comm.update_topology)
    step(index, "recover")
    x = np.ones(1024, np.float32)
    while True:
        try:
            info = comm.all_reduce(x)
        except shoal.PeerLostError:
            comm.update_topology()
            continue
        # A call in flight when the peer died either raised or ran again without it by itself.
        if info.world_size == n:
            out["recovered_at"] = time.time()
            break
    step(index, "done")
    comm.close()
    print("RESULT " + json.dumps(out), flush=True)


def newcomer(args: argparse.Namespace) -> None:
    """The peer that joins a running group, then all-reduces until it is killed."""
    comm = shoal.Communicator(args.master, timeout=120)
    took = timed(lambda: comm.connect(timeout=120))
    print("RESULT " + json.dumps({"connect_s": took}), flush=True)
    x = np.ones(1024, np.float32)
    while True:
        try:
            comm.all_reduce(x)
        except shoal.PeerLostError:
            comm.update_topology()


def measure(n: int, args: argparse.Namespace) -> dict:
    lab = Lab(args.lab) if args.lab else None

    def place(i: int, argv: list[str]) -> list[str]:
        """Peer `i`'s command: in the lab's host `i` (round the hosts), else as it is."""
        return lab.argv(lab.hosts[i % len(lab.hosts)], argv) if lab else argv

    listen = "0.0.0.0:48148" if lab else "127.0.0.1:0"
    master = subprocess.Popen(place(0, [sys.executable, "-m", "shoal.cli", "master", "--listen", listen]),
                              stdout=subprocess.PIPE, text=True)
    procs: list[subprocess.Popen] = []
    try:
        assert master.stdout is not None
        address = master.stdout.readline().split()[-1]
        if lab:
            address = f"{lab.address(lab.hosts[0])}:48148"
        worker = [sys.executable, os.path.abspath(__file__), "--master", address, "--n", str(n), "--iters",
                  str(args.iters), "--state-mib", str(args.state_mib), "--rest", str(args.rest), "--sizes",
                  *args.sizes, *(["--optimize"] if args.optimize else [])]
        before = master_usage(master.pid)
        procs = [subprocess.Popen(place(i, [*worker, "--role", "member", "--index", str(i)]), stdout=subprocess.PIPE,
                                  text=True) for i in range(n)]
        usage = {"start": before}
        late = None
        killed_at = None
        lead = procs[0]
        assert lead.stdout is not None
        for line in lead.stdout:
            if line.startswith("RESULT "):
                results = [json.loads(line[7:])]
                break
            name = line.split()[1]
            usage[name] = master_usage(master.pid)
            if name == "admit":
                late = subprocess.Popen(place(n, [*worker, "--role", "newcomer", "--index", str(n)]),
                                        stdout=subprocess.PIPE, text=True)
            if name == "recover":
                time.sleep(1.0)
                assert late is not None and late.stdout is not None
                newcomer_out = json.loads(late.stdout.readline()[7:])
                killed_at = time.time()
                late.send_signal(signal.SIGKILL)
                late.wait()
        for p in procs[1:]:
            out, _ = p.communicate(timeout=300)
            results.append(json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:]))
        lead.wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
        master.terminate()
        master.communicate(timeout=30)
    steps = list(usage)
    cpu = {b: usage[b][0] - usage[a][0] for a, b in zip(steps, steps[1:])}
    row = {"peers": n, "algorithms": {s: results[0][f"all_reduce_{s}_algorithm"] for s in args.sizes}}
    for key in ("connect_s", "peers_pending_s", "update_topology_s", "sync_s", "sync_repair_s", "admit_s",
                *(f"all_reduce_{s}_s" for s in args.sizes)):
        values = [r[key] for r in results]
        row[key] = {"median": statistics.median(values), "max": max(values)}
    row["newcomer_connect_s"] = newcomer_out["connect_s"]
    recovered = [r["recovered_at"] - killed_at for r in results]
    row["recovery_s"] = {"median": statistics.median(recovered), "max": max(recovered)}
    # CPU spent while each step ran (the step named is the one that just began at the sample).
    row["master"] = {
        "join_cpu_s": cpu["votes"],
        "per_join_cpu_s": cpu["votes"] / n,
        "per_vote_cpu_s": cpu["sync"] / votes(args.iters),
        "rest_cpu_share": cpu["admit"] / args.rest,
        "admit_cpu_s": cpu["recover"],
        "recover_cpu_s": cpu["done"],
        "rss_mib": max(u[1] for u in usage.values()),
    }
    return row


DURATION = re.compile(r"([\d.]+)(ns|µs|us|ms|s)\b")


def seconds(text: str) -> float:
    value, unit = DURATION.match(text).groups()
    return float(value) * {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def simulate(peers: int) -> dict:
    """The simulator's large run of `peers`: its figures, from what the test prints."""
    env = {**os.environ, "SHOAL_SIM_LARGE": str(peers)}
    done = subprocess.run(["cargo", "test", "-q", "-p", "shoal-sim", "--release", "--test", "seeds", "a_large", "--",
                           "--nocapture"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    text = done.stderr
    crash = re.search(r"topology without it committed Some\(([^)]+)\)", text).group(1)
    join = re.search(r"topology with it committed Some\(([^)]+)\)", text).group(1)
    vote = re.search(r"Some\(([^)]+)\) after the first member's vote", text).group(1)
    master = re.search(r"master: (\d+) events, (\S+) in all, (\S+) each on average, slowest (\S+)", text)
    real = re.search(r"events in (\S+);", text).group(1)
    return {"peers": peers, "crash_to_commit_s": seconds(crash), "join_to_commit_s": seconds(join),
            "vote_to_commit_s": seconds(vote),
            "master_events": int(master.group(1)), "master_event_mean_s": seconds(master.group(3)),
            "master_event_slowest_s": seconds(master.group(4)), "real_s": seconds(real)}


def table(rows: list[dict], sims: list[dict], sizes: list[str]) -> str:
    ms = lambda v: f"{v * 1e3:.3g}"
    head = ["peers", "connect", "pending", "update", "sync", "repair", *sizes, "admit", "recover",
            "master per join", "per vote", "admit", "at rest", "RSS"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["peers"]), ms(r["connect_s"]["median"]), ms(r["peers_pending_s"]["median"]),
                 ms(r["update_topology_s"]["median"]), ms(r["sync_s"]["median"]), ms(r["sync_repair_s"]["median"]),
                 *(f"{ms(r[f'all_reduce_{s}_s']['median'])} {r['algorithms'][s]}" for s in sizes),
                 ms(r["admit_s"]["median"]), ms(r["recovery_s"]["median"]),
                 ms(r["master"]["per_join_cpu_s"]), ms(r["master"]["per_vote_cpu_s"]),
                 ms(r["master"]["admit_cpu_s"]), f"{r['master']['rest_cpu_share'] * 100:.2f}%",
                 f"{r['master']['rss_mib']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    # The slope on a log-log plot from the second row to the last: 1 is O(N), 2 is O(N^2).
    if len(rows) > 2:
        first, last = rows[1], rows[-1]
        span = math.log(last["peers"] / first["peers"])
        slope = lambda get: f"{math.log(get(last) / get(first)) / span:.2f}" if get(first) > 0 and get(last) > 0 \
            else "-"
        med = lambda key: lambda r: r[key]["median"]
        cells = [f"slope {first['peers']}->{last['peers']}",
                 *(slope(med(k)) for k in ("connect_s", "peers_pending_s", "update_topology_s", "sync_s",
                                           "sync_repair_s", *(f"all_reduce_{s}_s" for s in sizes),
                                           "admit_s", "recovery_s")),
                 slope(lambda r: r["master"]["per_join_cpu_s"]), slope(lambda r: r["master"]["per_vote_cpu_s"]),
                 slope(lambda r: r["master"]["admit_cpu_s"]), slope(lambda r: r["master"]["rest_cpu_share"]),
                 slope(lambda r: r["master"]["rss_mib"])]
        lines.append("| " + " | ".join(cells) + " |")
    text = ("ms, medians over the peers (connect: to accepted; the master's CPU ms per join, per vote, for the "
            "admission; at rest: its share of a core with every peer idle; RSS: MiB)\n\n" + "\n".join(lines))
    if sims:
        text += ("\n\nsimulator | crash -> commit | join -> commit | first vote -> commit | "
                 "master per event (mean / slowest) | real\n")
        text += "|---|---|---|---|---|---|\n"
        for s in sims:
            text += (f"| {s['peers']} | {ms(s['crash_to_commit_s'])} ms | {ms(s['join_to_commit_s'])} ms | "
                     f"{ms(s['vote_to_commit_s'])} ms | "
                     f"{s['master_event_mean_s'] * 1e6:.1f} µs / {ms(s['master_event_slowest_s'])} ms | "
                     f"{s['real_s']:.1f} s |\n")
    return text


def plot(rows: list[dict], sims: list[dict], sizes: list[str], out: Path, lab: str | None) -> list[Path]:
    """Log-log plots of every figure against N (named growth-lab-* for a lab's); returns the files written."""
    where, prefix = (f"lab {lab}", "growth-lab") if lab else ("loopback", "growth")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib (pip install matplotlib): no plots", file=sys.stderr)
        return []
    n = [r["peers"] for r in rows]
    med = lambda key: [r[key]["median"] * 1e3 for r in rows]
    panels = {
        f"{prefix}-membership.png": ("membership and votes (ms)", {
            "connect() to accepted": med("connect_s"), "peers_pending()": med("peers_pending_s"),
            "update_topology(), none pending": med("update_topology_s"),
            "update_topology() admitting one": med("admit_s"), "recovery after SIGKILL": med("recovery_s"),
            "sync, nothing to repair": med("sync_s"), "sync with a repair": med("sync_repair_s")}),
        f"{prefix}-all-reduce.png": ("all-reduce (ms)", {s: med(f"all_reduce_{s}_s") for s in sizes}),
        f"{prefix}-master.png": ("master", {
            "CPU ms per join": [r["master"]["per_join_cpu_s"] * 1e3 for r in rows],
            "CPU ms per vote": [r["master"]["per_vote_cpu_s"] * 1e3 for r in rows],
            "CPU ms admitting one": [r["master"]["admit_cpu_s"] * 1e3 for r in rows],
            "CPU % of a core at rest": [r["master"]["rest_cpu_share"] * 100 for r in rows],
            "RSS MiB": [r["master"]["rss_mib"] for r in rows]}),
    }
    written = []
    for name, (title, series) in panels.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, ys in series.items():
            ax.plot(n, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"peers (processes, {where}, 2 cores)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        written.append(out / name)
    if sims:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        sn = [s["peers"] for s in sims]
        ax.plot(sn, [s["crash_to_commit_s"] * 1e3 for s in sims], marker="o", label="crash -> commit (ms, simulated)")
        ax.plot(sn, [s["join_to_commit_s"] * 1e3 for s in sims], marker="o", label="join -> commit (ms, simulated)")
        ax.plot(sn, [s["vote_to_commit_s"] * 1e3 for s in sims], marker="o",
                label="first vote -> commit (ms, simulated)")
        ax.plot(sn, [s["master_event_mean_s"] * 1e6 for s in sims], marker="o", label="master per event, mean (µs)")
        ax.plot(sn, [s["master_event_slowest_s"] * 1e6 for s in sims], marker="o", label="master slowest event (µs)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("peers (simulator)")
        ax.set_title("simulator: the shipped machines, simulated network")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "growth-simulator.png", dpi=90)
        plt.close(fig)
        written.append(out / "growth-simulator.png")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--sizes", nargs="+", default=["4K", "1M", "64M"])
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions of each small step")
    parser.add_argument("--state-mib", type=int, default=16, help="shared state synced")
    parser.add_argument("--optimize", action="store_true",
                        help="optimize_topology() once every peer is in (sites, limits), before the steps")
    parser.add_argument("--rest", type=float, default=5.0, help="seconds idle, for the master at rest")
    parser.add_argument("--big-max-peers", type=int, default=32,
                        help="sizes of 16 MiB and more only up to this many peers (memory: each holds copies)")
    parser.add_argument("--sim", action="store_true", help="add the simulator's large run")
    parser.add_argument("--sim-peers", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--out", type=Path, default=Path("growth"))
    parser.add_argument("--lab", help="run the master and peers in this lab's hosts, peer i in host i (shoal lab up)")
    # Worker processes.
    parser.add_argument("--role", choices=["member", "newcomer"], help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "member":
        return member(args)
    if args.role == "newcomer":
        return newcomer(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.peers:
        sizes = [s for s in args.sizes if parse_size(s) < 16 << 20 or n <= args.big_max_peers]
        run = argparse.Namespace(**{**vars(args), "sizes": sizes})
        row = measure(n, run)
        for s in args.sizes:
            row.setdefault(f"all_reduce_{s}_s", {"median": float("nan"), "max": float("nan")})
            row["algorithms"].setdefault(s, "-")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    sims = [simulate(p) for p in args.sim_peers] if args.sim else []
    (args.out / "growth.json").write_text(json.dumps({"rows": rows, "simulator": sims}, indent=1))
    print(table(rows, sims, args.sizes))
    for path in plot(rows, sims, args.sizes, args.out, args.lab):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
