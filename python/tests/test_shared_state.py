"""sync_shared_state with real peer processes: a newcomer repaired into a running training loop,
each strategy, every dtype, a donor killed mid-transfer, and the rules (revision, resume)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import run_peers

import shoal


def test_a_newcomer_is_repaired_and_then_stays_identical(master, tmp_path):
    # Three peers train from the start; the fourth arrives later with zeros. In a peer group other
    # than 0: the state, its revision and the newcomer's admission are the group's.
    results = run_peers(master, tmp_path, "sgd", 4, steps=60, late=0.4, timeout=120, group=5)
    by_revision: dict[int, set] = {}
    for r in results:
        for rec in r["records"]:
            by_revision.setdefault(rec["revision"], set()).add(rec["hash"])
    assert all(len(h) == 1 for h in by_revision.values()), "peers diverged"
    late = results[3]["records"]
    assert late[0]["received"] == ["momentum", "w"], late[0]
    assert late[0]["revision"] > 1 and late[-1]["world"] == 4 and len(late) >= 5, late
    assert len({r["loss"] for r in results}) == 1 and results[0]["loss"] < 50


@pytest.mark.parametrize("case", ["popular", "send_only", "receive_only"])
def test_strategies(master, tmp_path, case):
    results = run_peers(master, tmp_path, "sync_case", 3, case=case)
    assert len({tuple(sorted(r["hashes"].items())) for r in results}) == 1, results
    odd = results[0]
    if case == "send_only":
        # The authoritative peer's 7.0 wins over the popular 1.0; it never receives.
        assert odd["received"] == {} and all(r["received"] == {"w": [odd["peer_id"]]} for r in results[1:])
    else:
        # The odd one is outvoted (or takes what it is given): its one piece comes from one of
        # the others, whichever answered first (striping over both: the donor test below).
        (donor,) = odd["received"]["w"]
        assert donor in [r["peer_id"] for r in results[1:]], odd
        assert all(r["received"] == {} for r in results[1:])
    if case == "receive_only":
        assert odd["sent_to"] == [], "a receive_only peer never sends"


def test_every_dtype_is_synced(master, tmp_path):
    results = run_peers(master, tmp_path, "sync_case", 3, case="dtypes")
    assert len({tuple(sorted(r["hashes"].items())) for r in results}) == 1
    assert len(results[2]["received"]) == 13, results[2]["received"]


def test_a_donor_killed_mid_transfer_is_routed_around(master, tmp_path):
    # Peer 2 fetches 64 MiB striped from peers 0 and 1; peer 0 dies after serving one piece.
    import json
    import os
    import subprocess
    import sys

    from conftest import WORKER

    procs = []
    for i in range(3):
        spec = {"master": master.address, "index": i, "peers": 3, "case": "donor_dies", "mib": 64}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "sync_case", json.dumps(spec)],
                                      stdout=subprocess.PIPE, text=True,
                                      env={k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}))
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert procs[0].returncode != 0, "the donor did not die"
    survivors = [json.loads(o.strip().splitlines()[-1]) for o in outs[1:]]
    assert all("error" not in r for r in survivors), survivors
    assert survivors[0]["hashes"] == survivors[1]["hashes"]
    assert len(survivors[1]["received"]["big"]) == 2, "it did not start striped over both donors"


def run_together(comms, fn):
    """Calls ``fn(i, comm)`` on every communicator at once; returns results or exceptions."""
    out = [None] * len(comms)

    def one(i):
        try:
            out[i] = fn(i, comms[i])
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def joined(master, n):
    comms = [shoal.Communicator(master.address, timeout=20) for _ in range(n)]
    run_together(comms, lambda i, c: c.connect(timeout=20, min_world_size=n))
    return comms


def test_revisions_advance_by_one_and_an_impossible_one_is_refused(master):
    comms = joined(master, 2)
    states = [shoal.SharedState({"w": np.ones(10, np.float32)}, revision=4) for _ in comms]
    assert [r.revision for r in run_together(comms, lambda i, c: c.sync_shared_state(states[i]))] == [4, 4]
    states[0].revision = 5
    states[1].revision = 9
    errors = run_together(comms, lambda i, c: c.sync_shared_state(states[i]))
    for e in errors:
        assert isinstance(e, shoal.UsageError) and "claims revision 9" in str(e), e
    # A peer behind is repaired and brought to the run's revision.
    states[0].revision, states[1].revision = 5, 3
    states[1].tensors["w"][:] = 0
    infos = run_together(comms, lambda i, c: c.sync_shared_state(states[i]))
    assert [i.revision for i in infos] == [5, 5] and infos[1].received == {"w": [comms[0].peer_id]}
    assert (states[1].tensors["w"] == 1).all()
    # A step retried after a failure syncs the same revision again: the run stays there.
    assert [i.revision for i in run_together(comms, lambda i, c: c.sync_shared_state(states[i]))] == [5, 5]
    for c in comms:
        c.close()


def test_a_run_whose_peers_all_left_resumes_only_from_its_last_state(master):
    comms = joined(master, 2)
    agreed = np.arange(8, dtype=np.float32)
    states = [shoal.SharedState({"w": agreed.copy()}, revision=7) for _ in comms]
    run_together(comms, lambda i, c: c.sync_shared_state(states[i]))
    for c in comms:
        c.close()
    # Everyone left. Peers that come back with another state are refused...
    comms = joined(master, 2)
    other = [shoal.SharedState({"w": agreed + 1}, revision=7) for _ in comms]
    for e in run_together(comms, lambda i, c: c.sync_shared_state(other[i])):
        assert isinstance(e, shoal.UsageError) and "last agreed on (revision 7)" in str(e), e
    # ...unless they say so; one that holds the agreed state is the donor of the other.
    mixed = [shoal.SharedState({"w": agreed.copy()}, revision=7), shoal.SharedState({"w": agreed + 1}, revision=7)]
    infos = run_together(comms, lambda i, c: c.sync_shared_state(mixed[i]))
    assert infos[1].received == {"w": [comms[0].peer_id]} and (mixed[1].tensors["w"] == agreed).all(), infos
    infos = run_together(comms, lambda i, c: c.sync_shared_state(other[i], override_resume=True))
    assert all(isinstance(i, shoal.SyncInfo) for i in infos), infos
    for c in comms:
        c.close()


def test_states_that_do_not_fit_together_fail_on_every_peer(master):
    comms = joined(master, 2)
    states = [shoal.SharedState({"w": np.ones(10, np.float32)}), shoal.SharedState({"w": np.ones(11, np.float32)})]
    for e in run_together(comms, lambda i, c: c.sync_shared_state(states[i])):
        assert isinstance(e, shoal.UsageError) and "shared states differ" in str(e), e
    with pytest.raises(ValueError, match="strategy"):
        comms[0].sync_shared_state(states[0], "everyone")
    with pytest.raises(ValueError, match="allowed_to_differ"):
        shoal.SharedState({"w": np.ones(1)}, allowed_to_differ=["x"])
    for c in comms:
        c.close()


def test_tensors_allowed_to_differ_go_only_to_newcomers(master):
    comms = joined(master, 2)
    states = [shoal.SharedState({"w": np.ones(4, np.float32), "rng": np.full(3, i, np.uint64)},
                                allowed_to_differ=["rng"]) for i in range(2)]
    infos = run_together(comms, lambda i, c: c.sync_shared_state(states[i]))
    assert [i.received for i in infos] == [{}, {}], "accepted peers keep their own"
    assert [int(s.tensors["rng"][0]) for s in states] == [0, 1]
    # A newcomer is admitted and receives everything, including a synced peer's rng.
    newcomer = shoal.Communicator(master.address, timeout=20)
    all3 = comms + [newcomer]

    def admit(i, c):
        if c is newcomer:
            c.connect(timeout=20)
        else:
            while not c.peers_pending():
                time.sleep(0.02)
            c.update_topology()

    run_together(all3, admit)
    states.append(shoal.SharedState({"w": np.zeros(4, np.float32), "rng": np.full(3, 9, np.uint64)},
                                    allowed_to_differ=["rng"]))
    for s in states:
        s.revision = 1
    infos = run_together(all3, lambda i, c: c.sync_shared_state(states[i]))
    assert sorted(infos[2].received) == ["rng", "w"] and infos[0].received == infos[1].received == {}, infos
    assert int(states[2].tensors["rng"][0]) in (0, 1) and [int(s.tensors["rng"][0]) for s in states[:2]] == [0, 1]
    for c in all3:
        c.close()
