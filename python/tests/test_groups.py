"""Peer groups are admitted, voted and re-formed apart: several communicators in one process, each
in its own group, connect and run side by side, and a group's newcomers are admitted by its own
members while another group's members are busy elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env, run_peers, start_ready

import shoal

STEPS = 5


def test_a_pipeline_of_two_stages_replicated_twice_connects_and_trains(master: shoal.Master,
                                                                      tmp_path: Path) -> None:
    """Four processes, each with a communicator for its pipeline (group 200 + replica: send/recv)
    and one for its stage's replicas (group 100 + stage: all-reduce), connected in turn. With
    admission run-wide every second connect() waited for members blocked in their own connect()
    (60 s, then a timeout); per group, each connect waits only for its own group's members."""
    out = run_peers(master, tmp_path, "pipeline_dp", 4, timeout=60, connect_timeout=20, steps=STEPS)
    for i, o in enumerate(out):
        replica, stage = divmod(i, 2)
        # Stage 1 doubles what stage 0 sent it (replica * 10 + step); the replicas' sum of that.
        assert o["grads"] == [2 * (0 + step) + 2 * (10 + step) for step in range(STEPS)], (i, o)
        pipe, dp, world = o["sizes"]
        assert (pipe, dp) == (2, 2) and 4 <= world <= 8, o
        assert o["connected_s"] < 15, f"process {i} (replica {replica}, stage {stage}) took {o['connected_s']:.1f} s"


def test_groups_derived_from_one_communicator_run_a_pipeline_without_a_new_admission(
        master: shoal.Master, tmp_path: Path) -> None:
    """Four processes in one group derive each pipeline and each stage's replicas with ``split``,
    ranked by the keys they give, and train a few steps over the group's connections;
    ``new_group`` picks the first and last. Then the last process is SIGKILLed while its stage's
    other replica waits for it in an all-reduce: that call fails as ``PeerLostError`` and the
    retry runs in the derived group of the one member left."""
    out = run_peers(master, tmp_path, "derived", 4, timeout=60, steps=STEPS, die=str(tmp_path / "waiting"),
                    expect_killed=frozenset({3}))
    for i, o in enumerate(out[:3]):
        replica, stage = divmod(i, 2)
        assert o["grads"] == [2 * (0 + step) + 2 * (10 + step) for step in range(STEPS)], o
        assert o["sizes"] == [2, 2] and o["ranks"] == [stage, replica], o
        assert o["ends"] == (2.0 if o["rank"] in (0, 3) else None), o
    assert out[1]["after"] == {"errors": ["PeerLostError"], "world": 1, "sum": 1.0}, out[1]


def test_a_group_admits_its_newcomers_while_another_group_is_busy(master: shoal.Master, tmp_path: Path) -> None:
    """Two members of group 0 join and then sit in no call (alive, not voting) for longer than the
    test; two peers of group 1 register meanwhile and are admitted at once, by each other. Before,
    they waited for group 0's members to vote or leave (12 s in the issue's run)."""
    specs = [{"master": master.address, "index": i, "peers": 2, "busy": 30.0} for i in range(2)]
    busy = start_ready("busy", specs)
    try:
        out = run_peers(master, tmp_path, "min_world", 2, timeout=40, group=1, delay=0.0)
        for o in out:
            assert o["world"] == 2 and o["sum"] == 2.0, o
            assert o["connect_s"] < 5, f"a newcomer of group 1 waited {o['connect_s']:.1f} s for group 0"
        assert all(p.poll() is None for p in busy), "group 0's members are still in the run, untouched"
    finally:
        for p in busy:
            p.kill()
            p.communicate(timeout=10)


def test_the_hybrid_example_loses_a_stage_and_grows_a_replica_back() -> None:
    """``examples/hybrid_pp_dp.py --demo``: three replicas of a two-stage torch pipeline; one
    stage is SIGKILLed mid-step, its partner leaves, the others go on with a smaller
    data-parallel world, a new replica catches up and joins, every stage ends bit-identical (the
    example checks each of these and exits non-zero otherwise)."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    example = Path(__file__).parents[2] / "examples" / "hybrid_pp_dp.py"
    out = subprocess.run([sys.executable, str(example), "--demo", "--replicas", "3", "--steps", "40"],
                         capture_output=True, text=True, timeout=240, env=clean_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[demo] ok: replica 2 lost its stage 1" in out.stdout, out.stdout[-2000:]
