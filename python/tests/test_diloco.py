"""shoal.torch among peer processes: DDP through DDPHook and the DiLoCo recipes keep every peer's
model (or anchor) bit-identical after every step, the model learns, and a peer killed mid-run
costs the others a retry."""

from __future__ import annotations

import pytest
from conftest import run_peers

# torch is the optional `shoal[torch]` extra, which shoal.torch needs; scripts/env installs it,
# so these run in CI and skip only where someone runs the suite without it.
pytest.importorskip("torch")


@pytest.mark.parametrize("variant", ["sync", "async", "int8"])
def test_diloco_peers_share_one_anchor_and_learn(master, tmp_path, variant):
    quantization = "int8" if variant == "int8" else None
    results = run_peers(master, tmp_path, "diloco", 3, outer=12, quantization=quantization,
                        **{"async": variant == "async"})
    for outer in [*range(1, 13), "final"]:
        hashes = {rec["hash"] for r in results for rec in r["records"] if rec["outer"] == outer}
        assert len(hashes) == 1, f"outer step {outer}: anchors differ"
    for r in results:
        assert r["errors"] == [] and [rec["world"] for rec in r["records"]] == [3] * 13
        assert r["after"] < 0.05 * r["before"], r


@pytest.mark.parametrize("variant", ["sync", "async"])
def test_diloco_goes_on_when_a_peer_dies(master, tmp_path, variant):
    spec = {"outer": 10, "victim": 2, "async": variant == "async"}
    results = run_peers(master, tmp_path, "diloco", 3, expect_killed={2}, **spec)
    survivors = [r for r in results if r is not None]
    assert len(survivors) == 2
    for outer in [*range(1, 11), "final"]:
        hashes = {rec["hash"] for r in survivors for rec in r["records"] if rec["outer"] == outer}
        assert len(hashes) == 1, f"outer step {outer}: anchors differ"
    for r in survivors:
        assert set(r["errors"]) <= {"PeerLostError"}
        assert r["records"][-1]["world"] == 2
        assert r["after"] < 0.05 * r["before"], r


@pytest.mark.parametrize("victim", [None, 2])
def test_ddp_through_the_hook_keeps_replicas_identical(master, tmp_path, victim):
    killed = {victim} if victim is not None else set()
    results = run_peers(master, tmp_path, "ddp", 3, expect_killed=killed, steps=30, victim=victim)
    survivors = [r for r in results if r is not None]
    for step in range(30):
        hashes = {rec["hash"] for r in survivors for rec in r["records"] if rec["step"] == step}
        assert len(hashes) == 1, f"step {step}: replicas differ"
    for r in survivors:
        assert set(r["errors"]) <= {"PeerLostError"} and (victim is not None or not r["errors"])
        assert r["records"][-1]["world"] == 3 - len(killed)
        assert r["last"] < 0.5 * r["first"], r


@pytest.mark.parametrize("variant", ["sync", "async"])
def test_a_newcomer_is_admitted_at_an_outer_step_and_takes_up_the_anchor(master, tmp_path, variant):
    # Peers 0 and 1 found the run; peer 2 connects after their outer step 4 and their next outer
    # step admits it (peers_pending, update_topology, a sync of anchor, momentum and count).
    results = run_peers(master, tmp_path, "diloco", 3, outer=14, late=2, pause=0.05, **{"async": variant == "async"})
    newcomer = results[2]["records"]
    joined_at = newcomer[0]["outer"]
    assert 4 < joined_at < 14 and newcomer[-1]["world"] == 3
    for outer in [*range(joined_at, 15), "final"]:
        hashes = {rec["hash"] for r in results for rec in r["records"] if rec["outer"] == outer}
        assert len(hashes) == 1, f"outer step {outer}: anchors differ"
    for r in results:
        assert r["errors"] == [] and r["after"] < 0.05 * r["before"], r
