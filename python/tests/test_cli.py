"""The shoal command: master in the foreground, bench and demo end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import shoal

SHOAL = [sys.executable, "-m", "shoal.cli"]


def test_master_command_serves_until_terminated():
    env = {**os.environ, "SHOAL_LOG": "info", "SHOAL_BOGUS": "1"}
    proc = subprocess.Popen([*SHOAL, "master", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("shoal master listening on 127.0.0.1:"), line
        address = line.split()[-1]
        with shoal.Communicator(address) as comm:
            comm.connect(timeout=10)
            x = np.ones(3, np.float32)
            comm.all_reduce(x)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "unknown environment variable SHOAL_BOGUS" in err
    assert "registered" in err  # SHOAL_LOG=info shows membership


def test_version():
    out = subprocess.run([*SHOAL, "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == f"shoal {shoal.__version__}\n"
    assert shoal.__version__.count(".") == 2


def test_bench_joins_a_given_master(master):
    out = subprocess.run([*SHOAL, "bench", "--master", master.address, "--peers", "2", "--sizes", "4K"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    # Left to choose, two peers of one host run a buffer this small one-shot.
    assert f"master {master.address}" in out and "all_reduce/oneshot        4096" in out


def test_bench_prints_json_rows():
    out = subprocess.run([*SHOAL, "bench", "--peers", "3", "--sizes", "4K,1M", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    rows = json.loads(out)
    assert [r["size"] for r in rows] == [4096, 1 << 20]
    # Left to choose: one-shot for the small buffer, the ring for the large one.
    assert [r["op"] for r in rows] == ["all_reduce/oneshot", "all_reduce/ring"]
    for r in rows:
        assert r["peers"] == 3 and r["time_us"] > 0 and r["busbw_gbs"] > 0 and r["p99_us"] >= r["time_us"]


def test_bench_runs_collectives_in_flight_at_once():
    out = subprocess.run([*SHOAL, "bench", "--peers", "2", "--sizes", "64K", "--in-flight", "4", "--max-iters", "20",
                          "--json"], capture_output=True, text=True, timeout=120, check=True).stdout
    (row,) = json.loads(out)
    assert row["op"] == "all_reducex4/ring" and row["size"] == 64 << 10 and row["iters"] == 20
    # The bandwidths count all four buffers.
    assert abs(row["algbw_gbs"] - 4 * row["size"] / (row["time_us"] * 1e3)) < 1e-6 * row["algbw_gbs"] + 1e-9


def test_bench_runs_the_algorithm_asked_for():
    out = subprocess.run([*SHOAL, "bench", "--peers", "2", "--sizes", "4K", "--algorithm", "oneshot", "--max-iters",
                          "20", "--json"], capture_output=True, text=True, timeout=120, check=True).stdout
    (row,) = json.loads(out)
    assert row["op"] == "all_reduce/oneshot", row


@pytest.mark.parametrize("op,factor", [("all_gather", 2 / 3), ("reduce_scatter", 2 / 3), ("broadcast", 1.0)])
def test_bench_runs_every_collective_with_its_bus_bandwidth(op, factor):
    out = subprocess.run([*SHOAL, "bench", "--peers", "3", "--sizes", "64K", "--op", op, "--max-iters", "10",
                          "--json"], capture_output=True, text=True, timeout=120, check=True).stdout
    (row,) = json.loads(out)
    assert row["op"].startswith(op + "/") and row["peers"] == 3, row
    assert abs(row["busbw_gbs"] - factor * row["algbw_gbs"]) < 1e-9 + 1e-6 * row["algbw_gbs"], row
    # all_gather and reduce_scatter move whole blocks: a multiple of the world's size.
    assert row["count"] % 3 == 0 or op == "broadcast", row


def test_demo_runs_to_the_end():
    out = subprocess.run([*SHOAL, "demo", "--peers", "3", "--join-interval", "0.3", "--steps", "5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2 of 3 peers finished" in out.stdout
    # With all three in, the average of 0, 1, 2 is 1; after peer 2 dies, that of 0 and 1.
    assert "over 3 peers -> 1.000" in out.stdout
    # The survivors go on without it (retrying the step it broke, if one was under way).
    assert "the run went on without the lost peer: now rank" in out.stdout
    assert "over 2 peers -> 0.500" in out.stdout
    # Each newcomer arrives with a zero model and is repaired from the peers already in.
    assert "model repaired at revision" in out.stdout
