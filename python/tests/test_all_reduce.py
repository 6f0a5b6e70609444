"""all_reduce across real peer processes: every dtype and op against numpy, bit-identical on
every peer, world sizes 1 to 8, torch tensors in place, and peers joining while others run."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_peers
from worker import DTYPES, OPS, inputs


def expected(dtype: str, op: str, peers: int) -> np.ndarray:
    xs = [inputs(dtype, op, r) for r in range(peers)]
    if op in ("sum", "avg", "prod"):
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = acc + x if op != "prod" else acc * x  # wraps like the library for integers
        if op == "avg":
            if np.dtype(dtype).kind == "f":
                return (acc.astype(np.float64) / peers).astype(dtype)
            return (acc.astype(np.float64) / peers).astype(np.int64).astype(dtype)  # truncates
        return acc
    return np.minimum.reduce(xs) if op == "min" else np.maximum.reduce(xs)


@pytest.mark.parametrize("peers,algorithm", [(1, None), (2, "ring"), (2, "oneshot"), (3, "ring"), (3, "oneshot"),
                                             (3, "twoshot"), (4, "twoshot"), (4, "hierarchical"), (5, None),
                                             (3, "doubling"), (5, "twolevel"), (8, "ring"),
                                             (12, "ring"), (12, None)])  # past 8: tokens by doubling
def test_every_dtype_and_op_matches_numpy_on_every_peer(master, tmp_path, peers, algorithm):
    # Small chunks and 3 connections so that even 1 KiB buffers cross several chunks and lanes.
    infos = run_peers(master, tmp_path, "matrix", peers, connections=3, chunk_bytes=4096, algorithm=algorithm)
    check_matrix(infos, tmp_path)
    # Left to choose, buffers this small run one-shot among three to eight, by doubling past that.
    chosen = algorithm or ("doubling" if peers > 8 else "oneshot" if peers > 2 else "ring")
    assert all(i["algorithms"] == [chosen] for i in infos), infos


def test_a_large_group_over_hosts_runs_two_level_by_itself(master, tmp_path):
    """12 peers that advertise three addresses (three hosts, four members each): left to
    choose, small all-reduces run one-shot to each host's leader, among the leaders and back."""
    peers = 12

    def on_host(i: int, argv: list[str]) -> list[str]:
        return ["env", f"SHOAL_ADVERTISE_ADDR=127.0.0.{1 + i % 3}", *argv]

    infos = run_peers(master, tmp_path, "matrix", peers, launch=on_host, connections=3, chunk_bytes=4096)
    check_matrix(infos, tmp_path)
    assert all(i["algorithms"] == ["twolevel"] for i in infos), infos


def test_all_gather_reduce_scatter_and_broadcast_match_numpy_on_every_peer(master, tmp_path):
    peers = 3
    infos = run_peers(master, tmp_path, "verbs", peers, timeout=120)
    by_rank = {i["rank"]: np.load(tmp_path / f"peer{k}.npz") for k, i in enumerate(infos)}
    for dtype in DTYPES:
        gathered = np.concatenate([inputs(dtype, "sum", r) for r in range(peers)])
        for r in range(peers):
            assert by_rank[r][f"gather/{dtype}"].tobytes() == gathered.tobytes(), (dtype, r)
            for algorithm in ("ring", "oneshot"):
                got = by_rank[r][f"broadcast/{dtype}/{algorithm}"]
                assert got.tobytes() == inputs(dtype, "sum", peers - 1).tobytes(), (dtype, algorithm, r)
        for op in OPS:
            for r in range(peers):
                # Rank r's block: block r of every peer's input, reduced.
                blocks = [inputs(dtype, op, p * peers + r) for p in range(peers)]
                want = _reduce(blocks, dtype, op)
                got = by_rank[r][f"scatter/{dtype}/{op}"]
                if op == "avg" and np.dtype(dtype).kind == "f":
                    np.testing.assert_allclose(got, want, rtol=2e-3 if dtype == "float16" else 1e-6)
                else:
                    assert got.tobytes() == want.tobytes(), (dtype, op, r)
    # The verbs in flight together (checked by each worker against its own results) and an
    # all-reduce among them.
    want = _reduce([inputs("float32", "sum", r) for r in range(peers)], "float32", "sum")
    for r in range(peers):
        assert by_rank[r]["async/all_reduce"].tobytes() == want.tobytes()


def _reduce(xs: list, dtype: str, op: str) -> np.ndarray:
    peers = len(xs)
    if op in ("sum", "avg", "prod"):
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = acc + x if op != "prod" else acc * x
        if op == "avg":
            if np.dtype(dtype).kind == "f":
                return (acc.astype(np.float64) / peers).astype(dtype)
            return (acc.astype(np.float64) / peers).astype(np.int64).astype(dtype)
        return acc
    return np.minimum.reduce(xs) if op == "min" else np.maximum.reduce(xs)


def test_links_open_when_a_schedule_needs_them_and_are_reused(master, tmp_path):
    peers = 4
    out = run_peers(master, tmp_path, "links", peers)
    for o in out:
        rank = o["rank"]
        nxt, prev = (rank + 1) % peers, (rank - 1) % peers
        assert o["ring"] == "ring"
        # The ring links only to its neighbours: streams out to the next, in from the previous.
        by_rank = {link["rank"]: link for link in o["after_ring"]}
        assert set(by_rank) == {nxt, prev}, o["after_ring"]
        assert by_rank[nxt]["streams_out"] >= 1 and by_rank[nxt]["tx_bytes"] > 0
        assert by_rank[prev]["streams_in"] >= 1 and by_rank[prev]["rx_bytes"] > 0
        # One-shot links to every other member, both ways; the second one opens nothing new.
        (first, links1), (second, links2) = o["after_oneshot"]
        assert first == second == "oneshot"
        assert {link["rank"] for link in links1} == set(range(peers)) - {rank}, links1
        assert all(link["streams_out"] >= 1 and link["streams_in"] >= 1 for link in links1), links1
        # Peers on one host: shared memory.
        assert all(link["transport"] == "shm" for link in links1), links1
        streams = lambda links: {(k["rank"], k["streams_out"], k["streams_in"]) for k in links}  # noqa: E731
        assert streams(links1) == streams(links2)
        far = next(k for k in links2 if k["rank"] == (rank + 2) % peers)
        assert far["tx_bytes"] == far["rx_bytes"] == 2 * 64 * 4, far


def check_matrix(infos: list[dict], tmp_path) -> None:
    """The ``matrix`` workers' results: bit-identical on every peer and equal to numpy's."""
    peers = len(infos)
    assert sorted(i["rank"] for i in infos) == list(range(peers))
    results = [np.load(tmp_path / f"peer{i}.npz") for i in range(peers)]
    for dtype in DTYPES:
        for op in OPS:
            key = f"{dtype}/{op}"
            first = results[0][key]
            for r in results[1:]:
                assert r[key].tobytes() == first.tobytes(), f"{key}: peers disagree"
            want = expected(dtype, op, peers)
            if op == "avg" and np.dtype(dtype).kind == "f":
                # Sum then one division: within rounding of the exact mean.
                np.testing.assert_allclose(first, want, rtol=2e-3 if dtype == "float16" else 1e-6)
            else:
                assert first.tobytes() == want.tobytes(), f"{key}: differs from numpy"


def test_torch_cpu_tensors_are_reduced_in_place(master, tmp_path):
    pytest.importorskip("torch")
    out = run_peers(master, tmp_path, "torch", 2, timeout=120)
    for result in out:
        for dtype in ["torch.float32", "torch.bfloat16", "torch.float16", "torch.int64", "torch.uint8"]:
            assert result[dtype] == [3.0, 3.0, 3.0], dtype
        assert result["requires_grad"] == [1.0, 1.0]
        # Quantized, bit-identical on both, near the exact average (1.5 times a ramp).
        for key, bound in [("bf16_int8", 0.03), ("ef_int4", 0.2)]:
            assert result[key] == out[0][key], key
            assert np.abs(np.array(result[key]) - 1.5 * np.linspace(-1, 1, 1000)).max() <= bound, key
        # The residual is what the peer's own encoding lost: at most half an int4 step of its block.
        assert 0 < result["ef_residual"] <= 0.5 * 4 / 15 * 1.01, result["ef_residual"]


def test_peers_join_one_by_one_while_the_others_run(master, tmp_path):
    out = run_peers(master, tmp_path, "join_late", 4, delay=0.4)
    # Everyone ends in the full world with the same exact result.
    want = (np.arange(10) * (1 + 2 + 3 + 4)).tolist()
    assert all(o["result"] == want for o in out)
    assert sorted(o["rank"] for o in out) == [0, 1, 2, 3]
    # The first peer started alone and saw the world grow.
    assert out[0]["seen"][0] == 1 and out[0]["seen"][-1] == 4


def test_optimize_topology_measures_every_link_and_the_run_goes_on(master, tmp_path):
    # In a peer group other than 0: the plan is the group's.
    results = run_peers(master, tmp_path, "optimize", 4, group=2)
    rings = {tuple(r["ring"]) for r in results}
    assert len(rings) == 1, rings
    (ring,) = rings
    assert sorted(ring) == sorted(r["peer_id"] for r in results), ring
    assert all(ring[r["rank"]] == r["peer_id"] for r in results), (ring, results)
    for r in results:
        assert r["sum"] == 4.0 and r["world"] == 4, r
        assert r["algorithm"] == "ring", "one host is one site"
        m = r["matrix"]
        assert len(m) == 4 and all(len(row) == 4 for row in m), m
        for a in range(4):
            for b in range(4):
                if a == b:
                    assert m[a][b] is None
                else:
                    assert m[a][b]["bytes_per_s"] > 1e6 and 0 < m[a][b]["rtt_s"] < 1.0, m[a][b]
    # Every member holds the same matrix, in the ranks of the topology in force.
    assert all(r["matrix"] == results[0]["matrix"] for r in results)
