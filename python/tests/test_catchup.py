"""Catching up: a newcomer fetches the group's shared state while the accepted peers go on
training, then the sync that admits it moves only what changed since (``docs/state.md``)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import clean_env, worker_argv

import shoal
from shoal.status import fetch as fetch_status
from shoal.status import render

MIB = 256


def start_members(master: shoal.Master, n: int, spec: dict, rate: int) -> list[subprocess.Popen]:
    env = {**clean_env(), "SHOAL_CATCHUP_RATE": str(rate)}
    procs = []
    for _ in range(n):
        member = {**spec, "master": master.address, "role": "member", "peers": n}
        procs.append(subprocess.Popen(worker_argv("catchup", member), stdout=subprocess.PIPE, text=True, env=env))
    for p in procs:
        assert p.stdout is not None and "ready" in p.stdout.readline()
    return procs


def wait_for_step(member: subprocess.Popen, step: int) -> None:
    """Reads what ``member`` printed until it reports ``step``."""
    assert member.stdout is not None
    for line in member.stdout:
        if json.loads(line).get("step", 0) >= step:
            return
    raise AssertionError("the member ended before that step")


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def check_hashes(results: list[dict], at_least: int) -> None:
    """Every peer holds the same state at every revision all of them reported."""
    common = set.intersection(*(set(r["hashes"]) for r in results))
    assert len(common) >= at_least, [sorted(r["hashes"]) for r in results]
    for revision in common:
        assert len({json.dumps(r["hashes"][revision], sort_keys=True) for r in results}) == 1, revision


def test_a_newcomer_catches_up_with_256_mib_while_three_peers_train():
    spec = {"mib": MIB, "steps_after": 4, "whole": 4, "pause": 0.02}
    with shoal.Master("127.0.0.1:0", http_addr="127.0.0.1:0") as master:
        # 40 MB/s per donor: the fetch lasts about 2 s, over several of the others' steps.
        members = start_members(master, 3, spec, rate=40_000_000)
        wait_for_step(members[0], 3)  # past step 2, where w changes for the last time
        newcomer = subprocess.Popen(worker_argv("catchup", {**spec, "master": master.address, "role": "newcomer"}),
                                    stdout=subprocess.PIPE, text=True, env=clean_env())
        # The master's status shows the catch-up as it goes, and `shoal status` draws its bar.
        deadline, seen = time.monotonic() + 60, None
        while seen is None and time.monotonic() < deadline and newcomer.poll() is None:
            status = fetch_status(master.http_address)
            seen = next((p for p in status["peers"] if p["state"] == "catching_up" and p.get("catch_up")), None)
            time.sleep(0.05)
        assert seen is not None, "the catch-up never showed in /status"
        assert seen["catch_up"]["total_bytes"] == (MIB << 20) + 8
        text = render(status)
        assert f"p{seen['id']} catching up [" in text and "1 catching up" in text, text
        assert "kept for newcomers by p0, p1, p2" in text, text
        out, _ = newcomer.communicate(timeout=240)
        assert newcomer.returncode == 0, out
        mine = last_json(out)
        progress = [json.loads(line)["progress"] for line in out.strip().splitlines()[:-1]]
        results = [mine]
        for p in members:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
            results.append(last_json(out))
    caught = mine["caught"]
    assert caught["revision"] is not None and caught["skipped"] is None, caught
    assert caught["bytes"] == (MIB << 20) + 8, "w and the step count"
    assert len(caught["donors"]) == 3
    assert progress and progress == sorted(progress) and progress[-1] == 1.0, progress
    # The members went on stepping while the newcomer fetched: steps began and ended inside the
    # catch-up.
    during = [(t0, d) for r in results[1:] for t0, d, _ in r["times"]
              if caught["started"] < t0 and t0 + d < caught["ended"]]
    assert during, "no member finished a step while the newcomer caught up"
    # The sync that admitted it moved the step count only: w did not change since the copy.
    assert mine["received"][0] <= 8, mine["received"]
    check_hashes(results, at_least=4)


def test_a_donor_killed_during_the_catch_up_hands_its_pieces_to_the_others():
    spec = {"mib": 128, "steps_after": 3, "whole": 3, "pause": 0.02}
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=3) as master:
        members = start_members(master, 3, {**spec, "heartbeat_timeout": 3}, rate=16_000_000)
        wait_for_step(members[0], 3)
        newcomer = subprocess.Popen(
            worker_argv("catchup", {**spec, "master": master.address, "role": "newcomer", "heartbeat_timeout": 3}),
            stdout=subprocess.PIPE, text=True, env=clean_env())
        assert newcomer.stdout is not None
        lines = []
        for line in newcomer.stdout:
            lines.append(line)
            if json.loads(line).get("progress", 0) >= 0.3:
                members[2].send_signal(signal.SIGKILL)
                break
        out, _ = newcomer.communicate(timeout=240)
        assert newcomer.returncode == 0, "".join(lines) + out
        mine = last_json(out)
        results = [mine]
        for p in members[:2]:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
            results.append(last_json(out))
        members[2].communicate(timeout=10)
    caught = mine["caught"]
    assert caught["revision"] is not None, caught
    assert caught["bytes"] == (128 << 20) + 8
    check_hashes(results, at_least=3)
    assert all(r["times"][-1][2] == 3 for r in results), "the run went on with the two members and the newcomer"


def test_a_catch_up_with_nothing_to_fetch_or_another_state_is_answered_at_once():
    def state(name: str, value: float) -> shoal.SharedState:
        return shoal.SharedState({name: np.full(4, value, np.float32)})

    group = 4  # any but 0: the state caught up with is the group's

    with shoal.Master("127.0.0.1:0") as master, shoal.Communicator(master.address, peer_group=group) as first:
        # The first peer: nobody holds a state to fetch.
        info = first.connect(timeout=10, catch_up=state("w", 1))
        assert info is not None and info.revision is None and "no shared state" in (info.skipped or "")
        first.sync_shared_state(state("w", 1))
        other = state("other", 0)
        with shoal.Communicator(master.address, peer_group=group) as second:
            with pytest.raises(shoal.UsageError, match='the run has "w" where peer#1 has "other"'):
                second.connect(timeout=10, catch_up=other)
        assert other.tensors["other"].tolist() == [0, 0, 0, 0], "nothing written"
        # No sync comes: the catch-up ends with connect's own bound, not SHOAL_TIMEOUT's.
        with shoal.Communicator(master.address, peer_group=group) as late:
            started = time.monotonic()
            with pytest.raises(shoal.ShoalTimeoutError, match="next sync"):
                late.connect(timeout=1, catch_up=state("w", 0))
            assert time.monotonic() - started < 10

        def member() -> None:
            # The next sync makes the copy the newcomer fetches; it is admitted once caught up.
            time.sleep(0.3)
            first.sync_shared_state(state("w", 1))
            while not first.peers_pending():
                time.sleep(0.05)
            first.update_topology()

        mine = state("w", 0)
        with shoal.Communicator(master.address, peer_group=group) as third:
            t = threading.Thread(target=member)
            t.start()
            seen = []
            info = third.connect(timeout=20, catch_up=mine, progress=seen.append)
            t.join()
        assert info is not None and info.revision == 0 and info.fetched_bytes == 16, info
        assert mine.tensors["w"].tolist() == [1, 1, 1, 1] and mine.revision == 0
        assert seen and seen[-1].done == seen[-1].total == 16
    with pytest.raises(ValueError, match="pass catch_up=state"):
        shoal.Communicator("127.0.0.1:1").connect(progress=True)
