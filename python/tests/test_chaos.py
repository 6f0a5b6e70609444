"""Bounded chaos rounds, on loopback and in a WAN lab with partitions: see chaos.py (the soak
is ``python python/tests/chaos.py``)."""

from __future__ import annotations

import os

import chaos
from conftest import need_lab

from shoal.lab import PROFILES, Lab


def test_chaos_round(tmp_path):
    summary = chaos.run(duration=12, seed=20261122, workdir=tmp_path)
    # Enough happened for the checks to mean something.
    assert summary["actions"] >= 5 and summary["successes"] >= 100 and summary["errors"] >= 1, summary
    assert summary["syncs"] >= 100 and summary["repaired"] >= 1, summary


def test_chaos_round_in_two_groups(tmp_path):
    """Two groups of one run (3 and 8), each with its own kills, freezes and newcomers: each
    one's collectives agree and its states match at every revision, whatever the other does."""
    summary = chaos.run(duration=12, seed=20261127, workdir=tmp_path, min_alive=4, max_alive=10, groups=(3, 8))
    assert summary["actions"] >= 5 and summary["successes"] >= 100 and summary["errors"] >= 1, summary
    assert summary["syncs"] >= 100, summary


def test_chaos_round_with_partitions_in_the_lab(tmp_path):
    need_lab()
    with Lab.up(PROFILES["two-sites"], name=f"t{os.getpid()}x", subnet="10.209.0.0/24", ttl=600) as lab:
        summary = chaos.run(duration=15, seed=20261123, workdir=tmp_path, lab=lab)
    assert summary["actions"] >= 5 and summary["successes"] >= 20 and summary["errors"] >= 1, summary
    assert summary["partitions"] >= 1, summary
