"""Every surviving participant of a collective returns the same outcome: all succeed with
identical bytes, or all fail with their buffers exactly as before the call. A peer is killed at
exact steps of the commit protocol with SHOAL_FAILPOINT, which signals from outside cannot hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import WORKER, run_peers

import shoal

PEERS = 4


def run_with_victim(master: shoal.Master, failpoint: str, steps: int = 4) -> list[dict]:
    procs = []
    for i in range(PEERS):
        spec = {"master": master.address, "index": i, "peers": PEERS, "steps": steps}
        if i == 2:
            spec["failpoint"] = failpoint
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "agree", json.dumps(spec)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}))
    results = []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=90)
        if i == 2:
            assert p.returncode != 0, "the failpoint did not fire"
            continue
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def assert_agreement(results: list[dict]) -> None:
    for step in zip(*(r["outcomes"] for r in results)):
        assert len({o["ok"] for o in step}) == 1, f"survivors disagree: {step}"
        if step[0]["ok"]:
            assert len({o["sha"] for o in step}) == 1, f"different results: {step}"
        else:
            assert all(o["restored"] for o in step), f"a buffer was not restored: {step}"


@pytest.mark.parametrize("failpoint", ["all_reduce.before_confirm", "all_reduce.after_commit"])
def test_a_participant_dying_once_it_holds_the_result_does_not_split_the_survivors(failpoint):
    # before_confirm: the victim holds the result but dies before its token goes round, so the
    # survivors cannot agree among themselves and ask the master, which commits: every survivor
    # holds the result. after_commit: the victim committed on its own and dies before telling the
    # master; the survivors committed on their own too.
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=5.0) as master:
        results = run_with_victim(master, failpoint)
    assert_agreement(results)
    first = [r["outcomes"][0] for r in results]
    assert all(o["ok"] and o["world"] == PEERS for o in first), first
    # The next one finds the victim gone, fails everywhere, and the run goes on without it.
    second = [r["outcomes"][1] for r in results]
    assert all(not o["ok"] and o["error"] == "PeerLostError" for o in second), second
    assert all(o["ok"] and o["world"] == PEERS - 1 for r in results for o in r["outcomes"][2:]), results


@pytest.mark.parametrize("vary", ["count", "dtype", "op", "tag"])
def test_mismatched_calls_fail_on_every_peer(master, tmp_path, vary):
    results = run_peers(master, tmp_path, "mismatch", 3, vary=vary)
    for r in results:
        assert r["error"] is not None and r["error"]["type"] == "CollectiveMismatchError", r
        assert r["error"]["restored"], r
        assert r["after"] == 3.0, "the run did not go on after the mismatch"


def test_a_collective_during_an_admission_vote_fails_on_every_peer(master, tmp_path):
    voter, *reducers = run_peers(master, tmp_path, "admission_misuse", 3)
    assert voter["error"]["type"] == "UsageError" and "update_topology" in voter["error"]["msg"], voter
    for r in reducers:
        assert r["error"]["type"] == "UsageError" and "all_reduce" in r["error"]["msg"], r
        assert r["restored"], r
    for r in [voter, *reducers]:
        assert r["took"] < 10, r  # not the 30 s call timeout
        assert r["after"] == 3.0, r
