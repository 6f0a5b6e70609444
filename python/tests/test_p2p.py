"""Tagged point-to-point transfers: matched by (peer, tag) in any order, every dtype, beside
collectives; mismatches fail both ends; a killed or frozen partner fails the other end within
the heartbeat bound, and transfers go on in the smaller world."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import clean_env, release, run_peers, start_ready

import shoal

HEARTBEAT_TIMEOUT = 2.0
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_tagged_transfers_match_in_any_order_and_mismatches_fail_both_ends(master: shoal.Master,
                                                                            tmp_path: Path) -> None:
    """Every dtype around the ring, beside collectives; several sends with one tag in order;
    receives from any member, which name the sender, and one that no member can serve, which
    ends with a usage error rather than at its bound; mismatches fail both ends."""
    results = sorted(run_peers(master, tmp_path, "p2p", 3, timeout=120), key=lambda r: r["rank"])
    for r in results:
        assert r["ok"], r
        assert r["back"] == [[0] * 3, [1] * 3, [2] * 3], "the n-th send with a tag meets the n-th receive"
        assert "this member's own" in r["errors"]["self"] and "ranks 0..3" in r["errors"]["self"], r
    assert results[0]["senders"] == {"1": [10, 11], "2": [20, 21]}, results[0]
    # Every other member waited in the barrier: the receive from any member ended at once.
    message, waited = results[0]["errors"]["any"]
    assert "recv from any member (p2p" in message and "barrier" in message, message
    assert waited < 15, f"{waited:.1f} s: the call's bound is 30 s"
    # Both ends name both calls.
    sender, receiver = results[0]["errors"], results[1]["errors"]
    for errors in (sender, receiver):
        assert "send(count=10, dtype=f32, tag=200)" in errors["size"], errors
        assert "recv(count=12, dtype=f32, tag=200)" in errors["size"], errors
        assert "recv(count=10, dtype=i32, tag=201)" in errors["dtype"], errors
    assert "size" not in results[2]["errors"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_lost_partner_fails_the_other_end_within_the_heartbeat_bound(sig) -> None:
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT) as master:
        specs = [{"master": master.address, "index": i, "peers": 3, "steps_after": 3,
                  "heartbeat_timeout": HEARTBEAT_TIMEOUT} for i in range(3)]
        procs = start_ready("p2p_ring", specs)
        time.sleep(0.3)
        lost_at = time.time()
        procs[1].send_signal(sig)
        try:
            for p in (procs[0], procs[2]):
                out, _ = p.communicate(timeout=90)
                assert p.returncode == 0, out
                r = json.loads(out.strip().splitlines()[-1])
                assert r["world"] == 2 and r["errors"], r
                # Bounded by the closed streams (killed) or the heartbeat timeout (frozen), not
                # by the 60 s call timeout; generous, as the machine is shared.
                assert r["errors"][0]["at"] - lost_at < HEARTBEAT_TIMEOUT + 4, r
        finally:
            release(procs[1], sig)


def test_the_pipeline_example_trains_four_stages_with_micro_batches(master: shoal.Master) -> None:
    procs = [subprocess.Popen([sys.executable, str(EXAMPLES / "pipeline_1f1b.py"), "--master", master.address,
                               "--stages", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env()) for _ in range(4)]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    assert sum("matches the unpipelined model" in out for out, _ in outputs) == 4, outputs


def test_transfers_check_their_arguments(master: shoal.Master) -> None:
    with shoal.Communicator(master.address) as comm:
        comm.connect(timeout=10)
        with pytest.raises(ValueError, match="peer must be a rank"):
            comm.send(np.ones(3, np.float32), peer=-1)
        # A rank the group does not have, or our own (either once a chaos peer's partner was lost
        # between the round's all-reduce and its transfer: the ranks moved) is most often the
        # run's change, not a bad argument.
        with pytest.raises(shoal.UsageError, match="rank 0, this member's own: .* has ranks 0..1"):
            comm.recv(np.ones(3, np.float32), peer=0)
        with pytest.raises(shoal.UsageError, match="rank 1, which it does not have"):
            comm.send(np.ones(3, np.float32), peer=1)
        with pytest.raises(ValueError, match="tag must be"):
            comm.isend(np.ones(3, np.float32), peer=1, tag=-2)
