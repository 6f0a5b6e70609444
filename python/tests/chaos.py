"""Chaos: peers train in rounds (``chaos_peer.py``: an all-reduce, then every verb at once with
tagged p2p between pairs that change every round, an int8 all-reduce among them, then a sync of a
shared state, now and then ``optimize_topology()``) in one or more peer groups while, every 0.5 to
1 s, random ones are killed (SIGKILL, every other one after a short stall so that it fails the
calls in flight), frozen (SIGSTOP, for less or more than the heartbeat timeout) or started (every
other newcomer catching up in the background), and now and then the ``shoal master`` process is
SIGKILLed and started again on its state directory and address. On loopback every process runs
here; in a WAN lab (``--lab PROFILE``, root) the master runs on its first host and peers round
the others, and random peers' hosts are also partitioned from every other host, or their links
slowed, for a while, then healed.

Afterwards: every completed operation must be identical on all its participants and correct,
every failed one must have restored its buffers, every p2p message delivered intact exactly once
or failed on both ends (unless the end that succeeded was removed from the run while the other
end's call ran: ``docs/protocol.md``), every peer's state (a newcomer's caught-up one too) must hash the same at
every revision, no call may have outlived its bound, and only peers on a partitioned host (or
newcomers dialing while the master restarted) may have lost the master. Every process's memory,
threads and descriptors are read about once a second (``resources.py``): none may grow past its
slack after its warm-up. The first peer of each group is never a victim, so that a run longer than
the warm-up checks at least one process through all of it (the others live seconds).

``test_chaos.py`` runs short rounds in the suite. A soak is opt-in::

    python python/tests/chaos.py --duration 1800 --seed 7 [--lab two-sites] [--plot resources.png]

It writes a summary (JSON) and, if the run fails, keeps its logs and says where.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

from resources import WARMUP, Sampler

import shoal
from shoal.lab import Lab

PEER = Path(__file__).with_name("chaos_peer.py")
HEARTBEAT_TIMEOUT = 1.5
KILL_STALL = 0.3  # well inside the heartbeat timeout: the master keeps the stalled peer
CALL_TIMEOUT = 30.0
# How long a peer waits for a silent master, and redials one whose connection broke: a restarted
# master (a Python process starting on two busy cores) and a partition's heal both fit in it.
PEER_HEARTBEAT_TIMEOUT = 5.0
# A call ends by a peer's loss within the heartbeat timeout, plus scheduling slack on 2 shared
# cores; never by the call timeout. Except connect: it waits for the accepted peers to admit the
# newcomer, which they do at their own pace (every fourth round, and again after each failure),
# so chaos among them may delay it up to its own timeout. A peer on a partitioned host hears
# nothing until the heal (and TCP's retransmission backoff after it) or until its own heartbeat
# timeout for the master.
BOUNDS = {"other": HEARTBEAT_TIMEOUT + 10.0, "connect": CALL_TIMEOUT + 5.0, "cut_off": PEER_HEARTBEAT_TIMEOUT + 10.0}
MASTER_PORT = 48148  # in the lab
RESTART_EVERY = 40.0  # seconds between the master's restarts, at least
SLOW_RATE = "20mbit"


class Master:
    """The run's ``shoal master`` process on its state directory, SIGKILLed and started again on
    the same address by :meth:`restart`; every incarnation is sampled."""

    def __init__(self, workdir: Path, lab: Optional[Lab], sampler: Sampler, env: dict) -> None:
        self.lab, self.sampler, self.env = lab, sampler, env
        self.state = workdir / "master-state"
        self.listen = f"0.0.0.0:{MASTER_PORT}" if lab else "127.0.0.1:0"
        self.started = 0
        self.p = self._start()
        self.address = f"{lab.address(lab.hosts[0])}:{MASTER_PORT}" if lab else self.listen

    def _start(self) -> subprocess.Popen:
        argv = [sys.executable, "-m", "shoal.cli", "master", "--listen", self.listen,
                "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--state-dir", str(self.state)]
        # Every decision of every incarnation, kept with a failing run's logs: its phases and
        # votes are what a stalled call is explained by.
        env = dict(self.env, SHOAL_LOG="info")
        with open(self.state.parent / "master.log", "a") as log:
            if self.lab:
                p = self.lab.popen(self.lab.hosts[0], argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            else:
                p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        first = p.stdout.readline() if p.stdout else ""
        if "listening on" not in first:
            shoal.lab.stop(p)
            raise AssertionError(f"the master did not start: {first!r}")
        if not self.lab:
            self.listen = first.split()[-1]  # the port it took, kept for the restarts
        self.started += 1
        self.sampler.watch("master" if self.started == 1 else f"master#{self.started}", p.pid)
        return p

    def restart(self) -> None:
        self.p.kill()
        self.p.communicate(timeout=10)
        self.p = self._start()

    def stop(self) -> None:
        shoal.lab.stop(self.p)


def run(duration: float, seed: int, workdir: Path, min_alive: int = 2, max_alive: int = 6,
        lab: Optional[Lab] = None, groups: tuple[int, ...] = (0,), plot: Optional[Path] = None,
        restart_every: float = RESTART_EVERY) -> dict:
    """With ``lab``, the master runs on its first host, peers round the others, and partitions
    and slow links join the chaos. Peer i joins group ``groups[i % len(groups)]``: each group is
    checked on its own (its collectives, its states by revision). ``plot``: where to draw the
    processes' resources. The master is restarted every ``restart_every`` seconds or a little
    more (the first time half that in)."""
    rng = random.Random(seed)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    stop = workdir / "stop"
    procs: dict[int, subprocess.Popen] = {}
    frozen: dict[int, float] = {}
    faulted: dict[str, float] = {}  # partitioned or slowed host -> when it heals
    slowed: set[str] = set()  # of those, the slowed ones
    ever_cut: set[int] = set()  # peers whose host was partitioned while they ran
    actions: list[str] = []
    peer_hosts = lab.hosts[1:] if lab else []
    anchors = set(range(len(groups)))  # peer i joins groups[i % len(groups)]
    initial = 4 * len(groups)
    sampler = Sampler()
    with ExitStack() as stack:
        stack.callback(sampler.stop)
        sampler.start()
        master = Master(workdir, lab, sampler, env)
        stack.callback(master.stop)
        stack.callback(_reap, procs)
        next_restart = time.time() + restart_every / 2

        def host(i: int) -> str:
            return peer_hosts[i % len(peer_hosts)]

        def act(what: str) -> None:
            actions.append(f"{time.time():.2f} {what}")
            with open(workdir / "actions.txt", "a") as f:  # kept with the logs of a failing run
                f.write(actions[-1] + "\n")

        def start(i: int) -> None:
            # Odd peers only retry a failed call; even ones vote update_topology first (README).
            spec = {"master": master.address, "group": groups[i % len(groups)],
                    "log": str(workdir / f"peer{i}.jsonl"), "retry_only": i % 2 == 1,
                    "catch_up": i >= initial and (i // 2) % 2 == 1,
                    "stop": str(stop), "call_timeout": CALL_TIMEOUT,
                    "heartbeat_timeout": PEER_HEARTBEAT_TIMEOUT}
            argv = [sys.executable, str(PEER), json.dumps(spec)]
            procs[i] = subprocess.Popen(lab.argv(host(i), argv) if lab else argv,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
            sampler.watch(f"peer{i}", procs[i].pid)  # `ip netns exec` runs it in its own process

        for i in range(initial):
            start(i)
        end = time.time() + duration
        while time.time() < end:
            time.sleep(rng.uniform(0.5, 1.0))
            for v, until in list(frozen.items()):
                if time.time() >= until:
                    procs[v].send_signal(signal.SIGCONT)
                    del frozen[v]
            for h, until in list(faulted.items()):
                if lab and time.time() >= until:
                    lab.heal(h)
                    act(f"heal {h}")
                    del faulted[h]
                    slowed.discard(h)
            if time.time() >= next_restart:
                master.restart()
                act("restart master")
                next_restart = time.time() + restart_every * rng.uniform(1.0, 1.5)
                continue
            running = [i for i, p in procs.items() if p.poll() is None and i not in frozen]
            action = rng.choice(["kill", "freeze", "join", "partition", "slow"] if lab else ["kill", "freeze", "join"])
            if action in ("partition", "slow") and len(running) > min_alive:
                h = host(rng.choice(running))
                # One slowed host at a time: two would share the path between them, which the
                # lab slows once (with one group, both of a site's other hosts may be chosen).
                if h not in faulted and h not in {host(a) for a in anchors} and not (action == "slow" and slowed):
                    seconds = rng.uniform(0.3, 3.0)
                    cut = [i for i in running if host(i) == h]
                    if action == "partition":
                        lab.fault("partition", h)
                        ever_cut.update(cut)
                    else:
                        lab.fault("slow", h, rate=SLOW_RATE)
                        slowed.add(h)
                    faulted[h] = time.time() + seconds
                    named = f" (peers {' '.join(map(str, cut))})" if cut and action == "partition" else ""
                    act(f"{action} {h} for {seconds:.1f} s{named}")
            elif action == "join" and len(running) < max_alive:
                start(len(procs))
                act(f"start peer{len(procs) - 1}")
            elif action in ("kill", "freeze") and len(running) > min_alive:
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
                    act(f"SIGKILL peer{v}" + (f" after a {KILL_STALL} s stall" if stall else ""))
                else:
                    seconds = rng.uniform(0.3, 3.0)
                    procs[v].send_signal(signal.SIGSTOP)
                    frozen[v] = time.time() + seconds
                    act(f"SIGSTOP peer{v} for {seconds:.1f} s")
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


def _reap(procs: dict[int, subprocess.Popen]) -> None:
    """Kills what still runs of the peers (a failed run) and closes their pipes: nothing is left
    for a later test's garbage collection to warn about."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stderr:
            p.stderr.close()


def _log(workdir: Path, i: int) -> str:
    """What peer ``i`` recorded so far."""
    path = workdir / f"peer{i}.jsonl"
    return path.read_text() if path.exists() else ""


def _removed(actions: list[str]) -> defaultdict[int, list[float]]:
    """When each peer may have been removed from the run, by its index: killed, or frozen or
    partitioned long enough for the master to hear nothing from it for its heartbeat timeout
    (the silence begins up to a heartbeat interval, a quarter of the timeout, before the fault)."""
    long_enough = HEARTBEAT_TIMEOUT * 3 / 4
    removed: defaultdict[int, list[float]] = defaultdict(list)
    for a in actions:
        m = re.match(r"([\d.]+) (SIGKILL|SIGSTOP) peer(\d+)(?: for ([\d.]+) s)?", a)
        if m and (m[2] == "SIGKILL" or float(m[4]) >= long_enough):
            removed[int(m[3])].append(float(m[1]))
        m = re.match(r"([\d.]+) partition \S+ for ([\d.]+) s \(peers ([\d ]+)\)", a)
        if m and float(m[2]) >= long_enough:
            for i in m[3].split():
                removed[int(i)].append(float(m[1]))
    return removed


def analyse(workdir: Path, peers: int, actions: list[str], ever_cut: set[int] = frozenset(),
            groups: tuple[int, ...] = (0,)) -> dict:
    """Checks every peer's log (the module's docstring says what) and counts what happened."""
    results: dict[tuple, set] = defaultdict(set)
    states: dict[tuple[int, int], set] = defaultdict(set)
    sent: dict[tuple, dict] = {}
    received: dict[tuple, list[dict]] = defaultdict(list)
    calls: Counter = Counter()
    failures: Counter = Counter()
    syncs = repaired = caught_up = cut_off = replanned = 0
    longest = {"connect": 0.0, "cut_off": 0.0, "other": 0.0}
    # A newcomer dialing while the master restarts is refused (it may have started well before).
    restarts = [float(a.split()[0]) for a in actions if a.endswith(" restart master")]
    for i in range(peers):
        for line in _log(workdir, i).splitlines():
            r = json.loads(line)
            where = f"peer{i}: {r}\nactions:\n" + "\n".join(actions)
            assert "fatal" not in r, where
            if "seconds" in r:
                kind = "connect" if r["call"] == "connect" else "cut_off" if i in ever_cut else "other"
                longest[kind] = max(longest[kind], r["seconds"])
                assert r["seconds"] < BOUNDS[kind], f"a call outlived its bound: {where}"
            if "error" in r:
                failures[r["call"]] += 1
                assert r["restored"], f"buffer not restored: {where}"
            elif "seconds" in r:
                calls[r["call"]] += 1
            replanned += bool(r.get("replanned"))
            if "key" in r:
                assert r.get("correct", r.get("replanned")), f"wrong result: {where}"
                results[tuple(r["key"])].add(r["sha"])
            if "sent" in r:
                sent[tuple(r["sent"])] = dict(r, peer=i)
            if "received" in r and "call" in r:
                assert "error" in r or r["correct"], f"a message arrived damaged: {where}"
                received[tuple(r["received"])].append(dict(r, peer=i))
            if "revision" in r:
                states[(groups[i % len(groups)], r["revision"])].add(r["state"])
                if "caught_up" in r:
                    caught_up += 1
                else:
                    syncs += 1
                    repaired += bool(r["received"])
            if "master_unreachable" in r:
                cut_off += 1
                restarting = r["connecting"] and any(r["at"] - 15 < t < r["at"] + 1 for t in restarts)
                assert i in ever_cut or restarting, f"a peer lost the master without being cut off: {where}"
    for key, shas in results.items():
        assert len(shas) == 1, f"operation {key} differs between participants"
    for (group, revision), hashes in states.items():
        assert len(hashes) == 1, f"peers of group {group} hold different states at revision {revision}"
    removed = _removed(actions)
    decider_lost = 0
    for key, got in received.items():
        assert len(got) == 1, f"message {key} received {len(got)} times: {got}"
        if key in sent:  # both ends lived to say how it went
            send, recv = sent[key], got[0]
            if ("error" in send) != ("error" in recv):
                # The one way the ends may part (docs/protocol.md, "A transfer's outcome when its
                # links fail"): the end that succeeded was removed from the run while the other
                # end's call ran, and decided nothing that holds (the other end, waiting for its
                # word, heard that it was removed).
                done, failed = (recv, send) if "error" in send else (send, recv)
                ran = (failed["at"] - failed.get("seconds", 0.0) - 1.0, failed["at"])
                lost = "the master removed it" in failed["msg"] or any(
                    ran[0] <= t <= ran[1] for t in removed[done["peer"]])
                assert lost, f"message {key}: {send} but {recv}"
                decider_lost += 1
            assert "error" in recv or "error" in send or recv["sha"] == send["sha"], f"message {key} changed: {recv}"
    return {"operations": sum(calls.values()), "by_call": dict(sorted(calls.items())),
            "failures": sum(failures.values()), "failures_by_call": dict(sorted(failures.items())),
            "collectives": len(results), "messages": sum("error" not in g[0] for g in received.values()),
            "messages_decider_lost": decider_lost,
            "replanned": replanned, "syncs": syncs, "repaired": repaired, "caught_up": caught_up, "cut_off": cut_off,
            "longest_call_s": round(longest["other"], 2), "longest_connect_s": round(longest["connect"], 2),
            "longest_cut_off_call_s": round(longest["cut_off"], 2),
            "actions": len(actions),
            "by_action": dict(Counter(a.split()[1] for a in actions))}


def main() -> None:
    parser = argparse.ArgumentParser(description="shoal chaos soak")
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--lab", help="a lab profile to run in (root; builds a lab named 'chaos')")
    parser.add_argument("--keep", help="write the logs (JSON lines) and the summary to this new folder, and keep "
                                       "them (a failing run keeps them in any case, and says where)")
    parser.add_argument("--groups", default="0,1", help="peer groups to spread the peers over, e.g. 3,8")
    parser.add_argument("--plot", type=Path, help="draw every process's memory, threads and descriptors to this PNG")
    parser.add_argument("--restart-every", type=float, default=RESTART_EVERY,
                        help="seconds between the master's restarts, at least")
    args = parser.parse_args()
    groups = tuple(int(g) for g in args.groups.split(","))
    if args.keep:
        os.makedirs(args.keep)  # new: an old stop file would end the peers at once
    d = Path(args.keep or tempfile.mkdtemp(prefix=f"chaos-{args.seed}-"))
    with ExitStack() as stack:
        lab = stack.enter_context(Lab.up(shoal.lab.load(args.lab), name="chaos", subnet="10.209.0.0/24",
                                         ttl=args.duration + 600)) if args.lab else None
        print(f"seed {args.seed}", flush=True)
        min_alive, max_alive = 2 * len(groups), 6 * len(groups)
        try:
            summary = run(args.duration, args.seed, d, min_alive, max_alive, lab=lab, groups=groups,
                          plot=args.plot, restart_every=args.restart_every)
        except BaseException:
            print(f"the run failed: its logs are in {d}", file=sys.stderr, flush=True)
            raise
    summary["seed"] = args.seed
    (d / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    if not args.keep:
        shutil.rmtree(d)


if __name__ == "__main__":
    main()
