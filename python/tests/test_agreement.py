"""Every surviving participant of a collective returns the same outcome: all succeed with
identical bytes, or all fail with their buffers exactly as before the call. A peer is killed at
exact steps of the commit protocol with SHOAL_FAILPOINT, which signals from outside cannot hit."""

from __future__ import annotations

import json
import os
import re
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
    """Every failed attempt left its buffer as it was, and every step (retried until it
    succeeded) ended as the same collective with the same bytes on every survivor."""
    for r in results:
        assert all(o["restored"] for o in r["outcomes"] if not o["ok"]), f"a buffer was not restored: {r}"
    steps = [{o["step"]: o for o in r["outcomes"] if o["ok"]} for r in results]
    for step in steps[0]:
        done = [s[step] for s in steps]
        assert len({o["sha"] for o in done}) == 1, f"different results at step {step}: {done}"
        assert len({tuple(o["collective"]) for o in done}) == 1, f"step {step} ran as different collectives: {done}"


def assert_smaller_world_after(results: list[dict], first: int) -> None:
    """From step ``first`` on, the survivors run without the victim: at most one failed attempt
    (a survivor that started before the news), then successes in a world of ``PEERS - 1``."""
    for r in results:
        later = [o for o in r["outcomes"] if o["step"] >= first]
        failed = [o for o in later if not o["ok"]]
        assert len(failed) <= 1 and all(o["error"] == "PeerLostError" for o in failed), later
        assert all(o["world"] == PEERS - 1 for o in later if o["ok"]), later


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
    # The master re-forms the ring without the victim: the next collective runs in the smaller
    # world (a survivor that started it before the news fails once and retries).
    assert_smaller_world_after(results, 1)


@pytest.mark.parametrize("vary", ["count", "dtype", "op", "tag", "quantization"])
def test_mismatched_calls_fail_on_every_peer(master, tmp_path, vary):
    """Every peer that took part in the mismatched collective gets CollectiveMismatchError with its
    buffer restored (the odd one and its successor always do: the successor reads its header),
    and the run goes on after a retry. In a peer group other than 0."""
    results = run_peers(master, tmp_path, "mismatch", 3, vary=vary, group=4)
    erred = [r for r in results if r["error"] is not None]
    assert len(erred) >= 2 and any(r["odd"] for r in erred), results
    for r in erred:
        assert r["error"]["type"] == "CollectiveMismatchError", r
        assert r["error"]["restored"], r
    assert all(r["after"] == 3.0 for r in results), f"the run did not go on after the mismatch: {results}"
    if vary == "count":
        # Every message states the peer's own call, then both differing calls with their peers:
        # one that did not see the difference itself once read both sides as its own call.
        counts = {r["me"]: 11 if r["odd"] else 10 for r in results}
        for r in erred:
            msg = r["error"]["msg"]
            assert msg.startswith(f"collective mismatch: we called all_reduce(count={r['error']['count']},"), msg
            called = dict(re.findall(r"peer#(\d+) called all_reduce\(count=(\d+)", msg))
            assert len(set(called.values())) == 2, msg
            assert all(counts[int(p)] == int(c) for p, c in called.items()), (msg, counts)


@pytest.mark.parametrize("late", [None, 2])
def test_a_usage_error_never_outlives_its_call(master, tmp_path, late):
    """broadcast(root=99) fails on every peer with UsageError (``late``: on one that calls it after
    the others' calls failed too); the correct all_reduce after it then succeeds everywhere, never
    failing with the broadcast's stale usage error."""
    results = run_peers(master, tmp_path, "late_misuse", 3, late=late)
    for r in results:
        assert r["broadcast"] and r["broadcast"]["type"] == "UsageError" and "root" in r["broadcast"]["msg"], r
        assert r["after"] == {"sum": 3.0}, r
        assert r["took"] < 10, r


def test_after_a_mismatch_a_plain_retry_succeeds(master, tmp_path):
    """The loop that only retries: the ring re-forms by itself after the aborted collective."""
    results = run_peers(master, tmp_path, "mismatch", 3, vary="count", retry_only=True)
    assert all(r["after"] == 3.0 for r in results), results
    assert any(r["error"] and r["error"]["type"] == "CollectiveMismatchError" for r in results), results


def test_a_collective_during_an_admission_vote_fails_on_every_peer(master, tmp_path):
    voter, *reducers = run_peers(master, tmp_path, "admission_misuse", 3)
    assert voter["error"]["type"] == "UsageError" and "update_topology" in voter["error"]["msg"], voter
    for r in reducers:
        assert r["error"]["type"] == "UsageError" and "all_reduce" in r["error"]["msg"], r
        assert r["restored"], r
    # The calls, typed: every error names the vote and an all-reduce, each made by one peer.
    for r in [voter, *reducers]:
        called = {name: peers for peers, name in r["error"]["calls"]}
        assert sorted(called) == ["all_reduce", "update_topology"], r
        assert all(len(peers) == 1 for peers in called.values()), r
    for r in [voter, *reducers]:
        assert r["took"] < 10, r  # not the 30 s call timeout
        assert r["after"] == 3.0, r
