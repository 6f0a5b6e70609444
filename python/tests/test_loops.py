"""The loops users write keep going through churn, and calls that can never complete together
end at once instead of at SHOAL_TIMEOUT (docs/protocol.md, "Retry" and "No call waits for a call
that will never come").

Three shapes: the README's (update_topology after PeerLostError), the same without it (a failed
call is simply retried), and PCCL's (peers_pending / update_topology at the top of every
iteration, then the sync and the all-reduce). Each runs through a newcomer joining, a peer killed
(SIGKILL) and a peer frozen (SIGSTOP) for good."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from conftest import clean_env, run_peers, worker_argv

import shoal

HEARTBEAT_TIMEOUT = 1.5
STEPS = 90


def start(master: shoal.Master, shape: str, i: int) -> subprocess.Popen:
    spec = {"master": master.address, "index": i, "shape": shape, "steps": STEPS, "pause": 0.03,
            "heartbeat_timeout": HEARTBEAT_TIMEOUT}
    p = subprocess.Popen(worker_argv("loop", spec), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=clean_env())
    assert "ready" in p.stdout.readline(), p.stderr.read()
    return p


@pytest.mark.parametrize("shape", ["readme", "retry", "pccl"])
def test_every_loop_shape_goes_on_through_joins_kills_and_freezes(shape):
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT) as master:
        procs = [start(master, shape, i) for i in range(3)]
        time.sleep(0.4)
        procs.append(start(master, shape, 3))  # a newcomer, admitted by the others' loop
        time.sleep(0.6)
        procs[1].kill()
        time.sleep(0.5)
        procs[2].send_signal(signal.SIGSTOP)
        try:
            results = []
            for p in (procs[0], procs[3]):
                out, err = p.communicate(timeout=60)
                assert p.returncode == 0, err[-3000:]
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            procs[2].kill()
            for p in procs:
                p.communicate(timeout=10)  # reaps it and closes its pipes
    states: dict[int, set] = {}
    for r in results:
        assert r["steps"][-1]["revision"] == STEPS - 1, r["steps"][-1]
        assert r["steps"][-1]["world"] == 2, r["steps"][-1]
        # A failed call costs at most one retry per loss; no call waits past the heartbeat bound.
        assert len(r["errors"]) <= 2, r["errors"]
        assert r["longest"][0] < HEARTBEAT_TIMEOUT + 3, r["longest"]
        for s in r["steps"]:
            states.setdefault(s["revision"], set()).add(s["state"])
    assert all(len(h) == 1 for h in states.values()), "peers hold different states at one revision"


# Every call a peer group makes together that the master or a neighbour can see, and tagged
# transfers ("p2p": isend to the next rank, recv from the previous, then wait); a peer in one of them
# never meets a peer in another (docs/protocol.md, "No call waits for a call that will never come").
CALLS = ["all_reduce", "barrier", "peers_pending", "update_topology", "sync_shared_state", "optimize_topology", "p2p"]
# Calls that start with a collective: two of them differ as collectives do.
COLLECTIVES = {"all_reduce", "barrier", "optimize_topology"}


@pytest.mark.parametrize("order", ["first_last", "staggered"])
@pytest.mark.parametrize("first, others", [(a, b) for a in CALLS for b in CALLS if a != b])
def test_calls_that_cannot_complete_together_end_at_once_on_every_peer(master, tmp_path, first, others, order):
    """Peer 0 makes one call, peers 1 and 2 another, and then all stay alive and call nothing
    until every call ended: each call ends at once with an error naming both calls, never at
    SHOAL_TIMEOUT, even the one made last, after the others' calls ended ("staggered": peer 0,
    then peer 1 0.15 s later, peer 2 at 0.3 s); then a matching all-reduce works."""
    results = run_peers(master, tmp_path, "mismatched_calls", 3, first=first, others=others, order=order,
                        call_timeout=20)
    both_collectives = first in COLLECTIVES and others in COLLECTIVES
    for r in results:
        kind = "CollectiveMismatchError" if both_collectives else "UsageError"
        assert r["error"] and r["error"]["type"] == kind, r
        # optimize_topology is an update_topology vote that measured the links first.
        msg = r["error"]["msg"].replace("update_topology", "optimize_topology update_topology")
        assert first in msg and others in msg, r
        # The master's fixture has a 10 s heartbeat timeout: this is detection, not a timeout.
        assert r["took"] < 2.0, r
        assert r["after"] == 3.0, r
        # Its error was the only one: the matching all-reduce after it passes at the first try.
        assert not r["retried"], r
