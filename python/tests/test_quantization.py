"""Quantized collectives among real peer processes: bit-identical on every peer, within their
formats' error, with the bytes on the wire they promise; error feedback keeps the error from
accumulating."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_peers

import shoal

# Largest error of an average of 3 peers' normal inputs, about 3 times what was measured.
BOUNDS = {"fp16": 0.005, "bf16": 0.04, "int8": 0.06, "int4": 1.0}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quantized")
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=10.0) as master:
        results = run_peers(master, tmp, "quantized", 3, timeout=120)
    arrays = [np.load(tmp / f"peer{i}.npz") for i in range(3)]
    return results, arrays


def test_every_mode_dtype_and_algorithm_ends_bit_identical_on_every_peer(outcome):
    results, arrays = outcome
    keys = arrays[0].files
    assert len(keys) == 4 * 3 * 5 - 5 + 5, keys  # every combination but bf16 of float16, and 5 variants
    for key in keys:
        if key == "scatter":
            continue  # each peer holds its own block
        first = arrays[0][key].tobytes()
        assert all(a[key].tobytes() == first for a in arrays[1:]), f"{key} differs between peers"


def test_results_are_within_their_formats_error(outcome):
    results, _ = outcome
    for key, err in results[0]["errors"].items():
        q, dtype = (key.split("/") + ["", ""])[:2]
        if q in BOUNDS:
            bound = BOUNDS[q]
            if dtype == "float16" and q in ("int8", "int4"):
                bound += 0.004  # the float16 result's own rounding, at each hop
            assert err["max"] <= bound, (key, err)
            # Round to nearest: the mean error is a small fraction of the mean absolute error.
            assert abs(err["mean"]) <= err["mean_abs"] / 5 + 1e-9, (key, err)
        else:
            assert err["max"] <= (0.1 if key != "gather" else 0.03), (key, err)


def test_tx_bytes_show_the_compression(outcome):
    results, _ = outcome
    sent = results[0]["sent"]
    for algorithm in ["ring", "oneshot", "twoshot", "hierarchical", "twolevel"]:
        plain = sent[f"none/float32/{algorithm}"]
        ratio = {q: plain / sent[f"{q}/float32/{algorithm}"] for q in ["fp16", "bf16", "int8", "int4"]}
        assert 1.95 <= ratio["fp16"] <= 2.0 and 1.95 <= ratio["bf16"] <= 2.0, (algorithm, ratio)
        assert 3.6 <= ratio["int8"] <= 4.0 and 6.9 <= ratio["int4"] <= 8.0, (algorithm, ratio)
        # fp16 of a float16 tensor changes nothing, and sends as much.
        assert sent[f"fp16/float16/{algorithm}"] == sent[f"none/float16/{algorithm}"]


def test_meaningless_combinations_raise_value_error_before_any_traffic(outcome):
    results, _ = outcome
    refused = results[0]["refused"]
    assert len(refused) == 4, refused
    assert "float tensors, not i32" in refused[0] and "not max" in refused[1]
    assert "unknown quantization" in refused[2] and "not prod" in refused[3]


def test_error_feedback_keeps_the_error_from_accumulating(outcome):
    results, _ = outcome
    for r in results:
        drift = r["drift"]
        assert drift["feedback"] * 5 < drift["plain"], drift

