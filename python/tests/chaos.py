"""Chaos: peers all-reduce and sync a shared state in a loop while random ones are killed
(SIGKILL), frozen (SIGSTOP, for less or more than the heartbeat timeout) or started. Afterwards
every completed all-reduce must be identical on all its participants and correct, every failed
one must have restored its buffer, every peer's state must hash the same at every revision (a
newcomer once repaired), and no call may have outlived its bound.

``test_chaos.py`` runs a short round in the suite. A soak is opt-in::

    python python/tests/chaos.py --duration 600 --seed 7
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
from pathlib import Path

import shoal

WORKER = Path(__file__).with_name("worker.py")
HEARTBEAT_TIMEOUT = 1.5
CALL_TIMEOUT = 30.0
# A call ends by a peer's loss within the heartbeat timeout, plus scheduling slack on 2 shared
# cores; never by the call timeout.
CALL_BOUND = HEARTBEAT_TIMEOUT + 10.0


def run(duration: float, seed: int, workdir: Path, min_alive: int = 2, max_alive: int = 6) -> dict:
    rng = random.Random(seed)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    stop = workdir / "stop"
    procs: dict[int, subprocess.Popen] = {}
    frozen: dict[int, float] = {}
    actions: list[str] = []
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT) as master:

        def start(i: int) -> None:
            spec = {"master": master.address, "index": i, "log": str(workdir / f"peer{i}.jsonl"),
                    "stop": str(stop), "call_timeout": CALL_TIMEOUT}
            procs[i] = subprocess.Popen([sys.executable, str(WORKER), "chaos", json.dumps(spec)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)

        for i in range(4):
            start(i)
        end = time.time() + duration
        while time.time() < end:
            time.sleep(rng.uniform(0.4, 1.2))
            for v, until in list(frozen.items()):
                if time.time() >= until:
                    procs[v].send_signal(signal.SIGCONT)
                    del frozen[v]
            running = [i for i, p in procs.items() if p.poll() is None and i not in frozen]
            action = rng.choice(["kill", "freeze", "join"])
            if action == "join" and len(running) < max_alive:
                start(len(procs))
                actions.append(f"{time.time():.2f} start peer{len(procs) - 1}")
            elif action != "join" and len(running) > min_alive:
                v = rng.choice(running)
                if action == "kill":
                    procs[v].kill()
                    actions.append(f"{time.time():.2f} SIGKILL peer{v}")
                else:
                    seconds = rng.uniform(0.3, 3.0)
                    procs[v].send_signal(signal.SIGSTOP)
                    frozen[v] = time.time() + seconds
                    actions.append(f"{time.time():.2f} SIGSTOP peer{v} for {seconds:.1f} s")
        for v in frozen:
            procs[v].send_signal(signal.SIGCONT)
        stop.touch()
        for i, p in procs.items():
            try:
                _, err = p.communicate(timeout=CALL_TIMEOUT + 10)
            except subprocess.TimeoutExpired:
                p.kill()
                raise AssertionError(f"peer{i} did not stop: a call hangs") from None
            if p.returncode not in (0, -signal.SIGKILL):
                raise AssertionError(f"peer{i} exited {p.returncode}:\n{err.decode()[-3000:]}")
    return analyse(workdir, len(procs), actions)


def analyse(workdir: Path, peers: int, actions: list[str]) -> dict:
    results: dict[tuple, set] = defaultdict(set)
    states: dict[int, set] = defaultdict(set)
    syncs = repaired = 0
    successes = errors = 0
    longest = 0.0
    for i in range(peers):
        path = workdir / f"peer{i}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            r = json.loads(line)
            where = f"peer{i}: {r}\nactions:\n" + "\n".join(actions)
            if "seconds" in r:
                longest = max(longest, r["seconds"])
                assert r["seconds"] < CALL_BOUND, f"a call outlived its bound: {where}"
            if "key" in r:
                successes += 1
                assert r["correct"], f"wrong result: {where}"
                results[tuple(r["key"])].add(r["sha"])
            if "revision" in r:
                syncs += 1
                repaired += bool(r["received"])
                states[r["revision"]].add(r["state"])
            if "error" in r:
                errors += 1
                assert r["restored"], f"buffer not restored: {where}"
            assert "fatal" not in r, where
    for key, shas in results.items():
        assert len(shas) == 1, f"collective {key} differs between participants"
    for revision, hashes in states.items():
        assert len(hashes) == 1, f"peers hold different states at revision {revision}"
    return {"collectives": len(results), "successes": successes, "errors": errors, "syncs": syncs,
            "repaired": repaired,
            "longest_call_s": round(longest, 2), "actions": len(actions)}


def main() -> None:
    parser = argparse.ArgumentParser(description="shoal chaos soak")
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        print(f"seed {args.seed}", flush=True)
        print(json.dumps(run(args.duration, args.seed, Path(d))))


if __name__ == "__main__":
    main()
