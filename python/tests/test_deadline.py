"""Collectives with a deadline: a member that has not called an all-reduce (all-gather,
reduce-scatter, broadcast) by its deadline is left out by agreement, the others end with one
result over exactly themselves, and the member left out gets ExcludedError with its tensor
untouched and stays in the run."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_peers

import shoal

PEERS, LATE = 3, 2


def test_a_member_late_past_the_deadline_is_left_out_by_agreement(master: shoal.Master, tmp_path: Path) -> None:
    results = sorted(run_peers(master, tmp_path, "deadline", PEERS, timeout=120, late=LATE),
                     key=lambda r: r["rank"])
    by_rank = {r["rank"]: r for r in results}
    # Ranks follow admission: the late peer is the one left out of round 1.
    excluded = [r for r in results if "excluded" in r["rounds"][1]]
    assert len(excluded) == 1, [r["rounds"][1] for r in results]
    late_rank = excluded[0]["rank"]
    others = [r for r in results if r["rank"] != late_rank]
    for r in results:
        first, _, on_time, waited, _ = r["rounds"]
        # On time: everyone, the average of 1, 2, 3.
        assert first["included"] == list(range(PEERS)) and first["values"] == [2.0, 0.0], first
        assert on_time["included"] == list(range(PEERS)) and on_time["values"] == [2.0, 2.0], on_time
        # min_participants of the whole group: the late member is waited for.
        assert waited["included"] == list(range(PEERS)) and waited["values"] == [2.0, 3.0], waited
        assert r["world"] == PEERS and r["topology"] == first["topology"], "nobody was expelled, nothing re-formed"
    for rnd in (1, 4):
        late = by_rank[late_rank]["rounds"][rnd]
        # Untouched, told who took part, and at once: the others were done long before.
        assert "excluded" in late and late["values"] == [LATE + 1.0, float(rnd)], late
        assert late["included"] == sorted(r["rank"] for r in others) and late["took"] < 0.5, late
        values = {tuple(r["rounds"][rnd]["values"]) for r in others}
        mean = sum(i + 1 for i in range(PEERS) if i != LATE) / (PEERS - 1)
        assert values == {(mean, float(rnd))}, values
        for r in others:
            o = r["rounds"][rnd]
            assert o["included"] == late["included"] and o["world"] == PEERS - 1, o
            assert (o["topology"], o["sequence"]) == (late["topology"], late["sequence"]), (o, late)
            # The deadline, not the late member's second, bounds the others' call.
            assert o["took"] < 0.9, o


def test_a_member_far_behind_skips_ahead_through_what_the_others_ran_without_it(
        master: shoal.Master, tmp_path: Path) -> None:
    """The late member's first call after its lag is left out and says how many more the others
    ran without it (``ahead``); each next call is left out at once with one fewer, and the call
    after the last of them meets the others where they are: it is in it."""
    results = run_peers(master, tmp_path, "skip_ahead", PEERS, timeout=120, rounds=12, late=LATE, lag=1.5,
                        deadline=0.2)
    late = next(r for r in results if r["index"] == LATE)
    calls = late["calls"]
    skipped = [c for c in calls[1:] if "ahead" in c]
    aheads = [c["ahead"] for c in skipped]
    assert aheads and aheads[0] >= 1, calls
    first = next(i for i, c in enumerate(calls) if "ahead" in c)
    # A countdown, ending where it meets them (a call of the last round may still miss it by a hair).
    assert aheads[:aheads[0] + 1] == list(range(aheads[0], -1, -1)), aheads
    assert all(c["took"] < 0.5 for c in calls[first + 1:first + 1 + aheads[0]]), calls
    assert any("ahead" not in c for c in calls[first:]) and "ahead" not in calls[-1], calls
    # Every call names the same collective and set on every member; those that ran agree.
    for i in range(len(calls)):
        seen = {(r["calls"][i]["sequence"], tuple(r["calls"][i]["included"])) for r in results}
        assert len(seen) == 1, (i, seen)
        ran = {tuple(r["calls"][i]["values"]) for r in results if "ahead" not in r["calls"][i]}
        assert len(ran) == 1, (i, ran)


def test_all_gather_reduce_scatter_and_broadcast_take_a_deadline(master: shoal.Master, tmp_path: Path) -> None:
    """Each runs among the members in time: an all-gather fills their blocks alone, a
    reduce-scatter reduces over their inputs alone, a broadcast waits for its root however late
    and for nobody else; the member left out has its output untouched."""
    results = run_peers(master, tmp_path, "deadline_verbs", PEERS, timeout=120, late=LATE)
    late_rank = results[0]["late_rank"]
    others = sorted(r["rank"] for r in results if r["rank"] != late_rank)
    for i, verb in enumerate(r["verb"] for r in results[0]["calls"]):
        calls = {r["rank"]: r["calls"][i] for r in results}
        assert len({(c["sequence"], tuple(c["included"])) for c in calls.values()}) == 1, calls
        if verb == "broadcast_late":
            # The root is waited for, past the deadline: everyone takes part, its tensor everywhere.
            assert all(c["included"] == list(range(PEERS)) for c in calls.values()), calls
            assert all(c["out"] == [late_rank + 1.0] * 3 for c in calls.values()), calls
            continue
        late = calls[late_rank]
        assert late.get("excluded") and late["included"] == others and late["took"] < 0.5, (verb, late)
        if verb == "all_gather":
            assert late["out"] == [-1.0] * 2 * PEERS, late
            gathered = [v for r in range(PEERS) for v in ([r + 1.0] * 2 if r in others else [-1.0] * 2)]
            assert all(calls[r]["out"] == gathered for r in others), calls
        elif verb == "reduce_scatter":
            assert late["out"] == [-1.0] * 2, late
            for r in others:
                assert calls[r]["out"] == [sum(i + 1.0 + 10.0 * r for i in others)] * 2, (r, calls[r])
        else:
            assert late["out"] == [late_rank + 1.0] * 3, late
            assert all(calls[r]["out"] == [others[0] + 1.0] * 3 for r in others), calls
        assert all(calls[r]["world"] == len(others) and calls[r]["took"] < 0.9 for r in others), calls


def test_deadline_arguments_are_checked_before_anything_moves(master: shoal.Master) -> None:
    import numpy as np

    comm = shoal.Communicator(master.address)
    comm.connect(timeout=30)
    try:
        x = np.ones(4, np.float32)
        for bad in (-1.0, float("inf"), "1"):
            with pytest.raises(ValueError, match="deadline"):
                comm.all_reduce(x, deadline=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="min_participants"):
            comm.all_reduce(x, min_participants=2)
        with pytest.raises(ValueError, match="min_participants"):
            comm.all_reduce(x, deadline=1.0, min_participants=0)
        # Alone in its group: it runs at once.
        info = comm.all_reduce(x, op="sum", deadline=5.0)
        assert info.included == [0] and list(x) == [1.0] * 4
        out = np.zeros(4, np.float32)
        assert comm.all_gather(out, x, deadline=5.0).included == [0] and list(out) == [1.0] * 4
        out = np.zeros(4, np.float32)
        assert comm.reduce_scatter(out, x, deadline=5.0).included == [0] and list(out) == [1.0] * 4
        assert comm.broadcast(x, deadline=5.0).included == [0]
        with pytest.raises(ValueError, match="deadline"):
            comm.broadcast(x, deadline=-1.0)
    finally:
        comm.close()
