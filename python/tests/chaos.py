"""Chaos: peers all-reduce and sync a shared state in a loop while random ones are killed
(SIGKILL, every other one after a short stall so that it fails the calls in flight), frozen
(SIGSTOP, for less or more than the heartbeat timeout) or started, with a ``shoal master``
process (on loopback; in the lab, on its first host); in a WAN lab (``--lab
PROFILE``, root) the master and peers run on its hosts and random peers' hosts are also
partitioned from every other host for a while, then healed. Afterwards every completed
all-reduce must be identical on all its participants and correct, every failed one must have
restored its buffer, every peer's state must hash the same at every revision (a newcomer once
repaired), no call may have outlived its bound, and only peers on a partitioned host may have
lost the master. Every peer's memory, threads and descriptors are read about once a second
(``resources.py``): none may grow past its slack after its warm-up. The first peer of each group
is never a victim, so that a run longer than the warm-up checks at least one process through all
of it (the others live seconds).

``test_chaos.py`` runs short rounds in the suite. A soak is opt-in::

    python python/tests/chaos.py --duration 600 --seed 7 [--lab two-sites] [--plot resources.png]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

from resources import WARMUP, Sampler

import shoal
from shoal.lab import Lab

WORKER = Path(__file__).with_name("worker.py")
HEARTBEAT_TIMEOUT = 1.5
KILL_STALL = 0.3  # well inside the heartbeat timeout: the master keeps the stalled peer
CALL_TIMEOUT = 30.0
# A call ends by a peer's loss within the heartbeat timeout, plus scheduling slack on 2 shared
# cores; never by the call timeout. Except connect: it waits for the accepted peers to admit the
# newcomer, which they do at their own pace (every fifth collective, and again after each
# failure), so chaos among them may delay it up to its own timeout.
# A peer on a partitioned host hears nothing until the heal (and TCP's retransmission backoff
# after it) or until its own heartbeat timeout for the master, this long in the lab.
CUT_OFF_HEARTBEAT_TIMEOUT = 5.0
BOUNDS = {"other": HEARTBEAT_TIMEOUT + 10.0, "connect": CALL_TIMEOUT + 5.0, "cut_off": CUT_OFF_HEARTBEAT_TIMEOUT + 10.0}


def run(duration: float, seed: int, workdir: Path, min_alive: int = 2, max_alive: int = 6,
        lab: Optional[Lab] = None, groups: tuple[int, ...] = (0,), plot: Optional[Path] = None) -> dict:
    """With ``lab``, the master runs on its first host, peers round the others, and partitions
    join the chaos. Peer i joins group ``groups[i % len(groups)]``: each group is checked on its
    own (its collectives, its states by revision). ``plot``: where to draw the peers' resources."""
    rng = random.Random(seed)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    stop = workdir / "stop"
    procs: dict[int, subprocess.Popen] = {}
    frozen: dict[int, float] = {}
    cut: dict[str, float] = {}  # partitioned host -> when it heals
    ever_cut: set[int] = set()  # peers whose host was partitioned while they ran
    actions: list[str] = []
    peer_hosts = lab.hosts[1:] if lab else []
    anchors = set(range(len(groups)))  # peer i joins groups[i % len(groups)]
    sampler = Sampler()
    with ExitStack() as stack:
        stack.callback(sampler.stop)
        sampler.start()
        if lab:
            address = stack.enter_context(lab.master(lab.hosts[0], heartbeat_timeout=HEARTBEAT_TIMEOUT))
        else:
            # A process of its own, as in a run: its resources are sampled with the peers'.
            argv = [sys.executable, "-m", "shoal.cli", "master", "--listen", "127.0.0.1:0",
                    "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
            master = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
            stack.callback(shoal.lab.stop, master)
            first = master.stdout.readline() if master.stdout else ""
            if "listening on" not in first:
                raise AssertionError(f"the master did not start: {first!r}")
            address = first.split()[-1]
            sampler.watch("master", master.pid)

        def host(i: int) -> str:
            return peer_hosts[i % len(peer_hosts)]

        def start(i: int) -> None:
            # Odd peers only retry a failed call; even ones vote update_topology first (README).
            spec = {"master": address, "index": i, "group": groups[i % len(groups)],
                    "log": str(workdir / f"peer{i}.jsonl"),
                    "retry_only": i % 2 == 1,
                    "stop": str(stop), "call_timeout": CALL_TIMEOUT, "may_be_cut_off": bool(lab),
                    "heartbeat_timeout": CUT_OFF_HEARTBEAT_TIMEOUT if lab else None}
            argv = [sys.executable, str(WORKER), "chaos", json.dumps(spec)]
            procs[i] = subprocess.Popen(lab.argv(host(i), argv) if lab else argv,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
            sampler.watch(f"peer{i}", procs[i].pid)  # `ip netns exec` runs it in its own process

        for i in range(4 * len(groups)):
            start(i)
        end = time.time() + duration
        while time.time() < end:
            time.sleep(rng.uniform(0.4, 1.2))
            for v, until in list(frozen.items()):
                if time.time() >= until:
                    procs[v].send_signal(signal.SIGCONT)
                    del frozen[v]
            for h, until in list(cut.items()):
                if lab and time.time() >= until:
                    lab.heal(h)
                    actions.append(f"{time.time():.2f} heal {h}")
                    del cut[h]
            running = [i for i, p in procs.items() if p.poll() is None and i not in frozen]
            action = rng.choice(["kill", "freeze", "join", "partition"] if lab else ["kill", "freeze", "join"])
            if action == "partition" and len(running) > min_alive:
                h = host(rng.choice(running))
                if h not in cut and h not in {host(a) for a in anchors}:
                    seconds = rng.uniform(0.3, 3.0)
                    lab.fault("partition", h)
                    cut[h] = time.time() + seconds
                    ever_cut.update(i for i in running if host(i) == h)
                    actions.append(f"{time.time():.2f} partition {h} for {seconds:.1f} s")
            elif action == "join" and len(running) < max_alive:
                start(len(procs))
                actions.append(f"{time.time():.2f} start peer{len(procs) - 1}")
            elif action != "join" and len(running) > min_alive:
                # A peer that has run collectives, so that the fault lands in the run, not in a
                # newcomer's admission (on a loaded machine every kill could miss otherwise): none
                # yet, no fault this time (once, every peer was slow to start under the full
                # suite, and a round's kills all hit peers that had never run a collective).
                busy = [i for i in running if i not in anchors and '"key"' in _log(workdir, i)]
                if not busy:
                    continue
                v = rng.choice(busy)
                if action == "kill":
                    # Every other kill stalls the victim first, so that it lands inside the
                    # others' calls (they wait for it) and fails them; a plain SIGKILL between
                    # calls may fail none, the master hearing of the loss before the next one.
                    stall = sum(" SIGKILL " in a for a in actions) % 2 == 0
                    if stall:
                        procs[v].send_signal(signal.SIGSTOP)
                        time.sleep(KILL_STALL)
                    procs[v].kill()
                    stalled = f" after a {KILL_STALL} s stall" if stall else ""
                    actions.append(f"{time.time():.2f} SIGKILL peer{v}{stalled}")
                else:
                    seconds = rng.uniform(0.3, 3.0)
                    procs[v].send_signal(signal.SIGSTOP)
                    frozen[v] = time.time() + seconds
                    actions.append(f"{time.time():.2f} SIGSTOP peer{v} for {seconds:.1f} s")
        for v in frozen:
            procs[v].send_signal(signal.SIGCONT)
        if lab:
            lab.heal()
        stop.touch()
        for i, p in procs.items():
            try:
                _, err = p.communicate(timeout=CALL_TIMEOUT + 10)
            except subprocess.TimeoutExpired:
                p.kill()
                raise AssertionError(f"peer{i} did not stop: a call hangs") from None
            if p.returncode not in (0, -signal.SIGKILL):
                raise AssertionError(f"peer{i} exited {p.returncode}:\n{err.decode()[-3000:]}")
    summary = analyse(workdir, len(procs), actions, ever_cut, groups)
    summary["resources"] = sampler.summary()
    if plot:
        sampler.plot(plot)
    assert not summary["resources"]["leaks"], f"resources grew: {summary['resources']['leaks']}"
    if duration > WARMUP + 10:
        assert summary["resources"]["past_warmup"] >= len(anchors), f"no process lived past its warm-up: {summary}"
    return summary


def _log(workdir: Path, i: int) -> str:
    """What peer ``i`` recorded so far."""
    path = workdir / f"peer{i}.jsonl"
    return path.read_text() if path.exists() else ""


def analyse(workdir: Path, peers: int, actions: list[str], ever_cut: set[int] = frozenset(),
            groups: tuple[int, ...] = (0,)) -> dict:
    results: dict[tuple, set] = defaultdict(set)
    states: dict[tuple[int, int], set] = defaultdict(set)
    syncs = repaired = cut_off = 0
    successes = errors = 0
    longest = {"connect": 0.0, "cut_off": 0.0, "other": 0.0}
    for i in range(peers):
        path = workdir / f"peer{i}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            r = json.loads(line)
            where = f"peer{i}: {r}\nactions:\n" + "\n".join(actions)
            if "seconds" in r:
                kind = "connect" if r["call"] == "connect" else "cut_off" if i in ever_cut else "other"
                longest[kind] = max(longest[kind], r["seconds"])
                assert r["seconds"] < BOUNDS[kind], f"a call outlived its bound: {where}"
            if "key" in r:
                successes += 1
                assert r["correct"], f"wrong result: {where}"
                results[tuple(r["key"])].add(r["sha"])
            if "revision" in r:
                syncs += 1
                repaired += bool(r["received"])
                states[(groups[i % len(groups)], r["revision"])].add(r["state"])
            if "error" in r:
                errors += 1
                assert r["restored"], f"buffer not restored: {where}"
            assert "fatal" not in r, where
            if "master_unreachable" in r:
                cut_off += 1
                assert i in ever_cut, f"a peer lost the master without being cut off: {where}"
    for key, shas in results.items():
        assert len(shas) == 1, f"collective {key} differs between participants"
    for (group, revision), hashes in states.items():
        assert len(hashes) == 1, f"peers of group {group} hold different states at revision {revision}"
    return {"collectives": len(results), "successes": successes, "errors": errors, "syncs": syncs,
            "repaired": repaired, "cut_off": cut_off,
            "longest_call_s": round(longest["other"], 2), "longest_connect_s": round(longest["connect"], 2),
            "longest_cut_off_call_s": round(longest["cut_off"], 2),
            "actions": len(actions),
            "partitions": sum(a.split()[1] == "partition" for a in actions)}


def main() -> None:
    parser = argparse.ArgumentParser(description="shoal chaos soak")
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--lab", help="a lab profile to run in (root; builds a lab named 'chaos')")
    parser.add_argument("--keep", help="write the peers' logs (JSON lines) to this new folder, and keep them")
    parser.add_argument("--groups", default="0", help="peer groups to spread the peers over, e.g. 3,8")
    parser.add_argument("--plot", type=Path, help="draw every peer's memory, threads and descriptors to this PNG")
    args = parser.parse_args()
    groups = tuple(int(g) for g in args.groups.split(","))
    if args.keep:
        os.makedirs(args.keep)  # new: an old stop file would end the peers at once
    with ExitStack() as stack:
        d = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
        lab = stack.enter_context(Lab.up(shoal.lab.load(args.lab), name="chaos", subnet="10.209.0.0/24",
                                         ttl=args.duration + 600)) if args.lab else None
        print(f"seed {args.seed}", flush=True)
        min_alive, max_alive = 2 * len(groups), 6 * len(groups)
        print(json.dumps(run(args.duration, args.seed, Path(d), min_alive, max_alive, lab=lab, groups=groups,
                             plot=args.plot)))


if __name__ == "__main__":
    main()
