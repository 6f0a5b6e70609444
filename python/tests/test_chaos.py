"""Bounded chaos rounds of the whole mix, on loopback and in a WAN lab with partitions and slow
links: see chaos.py (the soak is ``python python/tests/chaos.py``)."""

from __future__ import annotations

import json
import os

import chaos
import pytest
from conftest import need_lab

from shoal.lab import PROFILES, Lab

VERBS = {"all_reduce", "all_reduce_int8", "all_gather", "broadcast", "reduce_scatter", "send", "recv", "sync",
         "optimize_topology"}


def enough(summary: dict) -> None:
    """Enough happened for the checks to mean something: every verb ran, faults failed some
    calls, and the master was restarted."""
    assert summary["actions"] >= 5 and summary["failures"] >= 1, summary
    assert summary["operations"] >= 100, summary
    assert not VERBS - summary["by_call"].keys(), f"never completed: {VERBS - summary['by_call'].keys()}: {summary}"
    assert summary["messages"] >= 1 and summary["by_action"].get("restart", 0) >= 1, summary


def test_chaos_round(tmp_path):
    summary = chaos.run(duration=12, seed=20261122, workdir=tmp_path, restart_every=10)
    enough(summary)
    assert summary["repaired"] + summary["caught_up"] >= 1, summary


def test_chaos_round_in_two_groups(tmp_path):
    """Two groups of one run (3 and 8), each with its own kills, freezes and newcomers: each
    one's collectives agree and its states match at every revision, whatever the other does."""
    summary = chaos.run(duration=12, seed=20261127, workdir=tmp_path, min_alive=4, max_alive=10, groups=(3, 8),
                        restart_every=10)
    enough(summary)


def test_chaos_round_with_partitions_in_the_lab(tmp_path):
    need_lab()
    with Lab.up(PROFILES["two-sites"], name=f"t{os.getpid()}x", subnet="10.209.0.0/24", ttl=600) as lab:
        summary = chaos.run(duration=15, seed=20261123, workdir=tmp_path, lab=lab, restart_every=10)
    enough(summary)
    assert summary["by_action"].get("partition", 0) + summary["by_action"].get("slow", 0) >= 1, summary


def test_a_message_apart_passes_only_where_the_end_that_succeeded_was_removed(tmp_path):
    """The analysis's p2p check: a message that succeeded at one end and failed at the other is a
    failure, unless the end that succeeded was removed from the run (killed, frozen or
    partitioned past the heartbeat timeout, or named removed by the other end's error) while the
    other end's call ran."""
    def run(actions, msg="lost peer#0 during recv: connection closed"):
        (tmp_path / "peer0.jsonl").write_text(json.dumps({"call": "send", "seconds": 0.1, "sent": [0, 1, 2, 0, 1],
                                                          "sha": "x", "at": 10.0}) + "\n")
        (tmp_path / "peer1.jsonl").write_text(json.dumps({"call": "recv", "seconds": 2.0, "error": "PeerLostError",
                                                          "restored": True, "msg": msg, "received": [0, 1, 2, 0, 1],
                                                          "at": 10.5}) + "\n")
        return chaos.analyse(tmp_path, 2, actions)

    with pytest.raises(AssertionError, match="message"):
        run([])
    with pytest.raises(AssertionError, match="message"):
        run(["10.2 SIGSTOP peer0 for 0.5 s"])  # frozen, not removed: its word still comes
    with pytest.raises(AssertionError, match="message"):
        run(["12.0 SIGKILL peer0"])  # killed after the other end had failed already
    with pytest.raises(AssertionError, match="message"):
        run(["9.0 partition a2 for 2.6 s (peers 1)"])  # another peer's host
    assert run(["10.2 SIGKILL peer0"])["messages_decider_lost"] == 1
    assert run(["10.1 SIGSTOP peer0 for 2.6 s"])["messages_decider_lost"] == 1
    assert run(["9.0 partition b2 for 1.5 s (peers 0 3)"])["messages_decider_lost"] == 1
    assert run([], msg="lost peer#0 during recv: the master removed it from the run")["messages_decider_lost"] == 1
