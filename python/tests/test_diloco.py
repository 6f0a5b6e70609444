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


@pytest.mark.parametrize("variant", ["sync", "async", "sync-deadline", "async-deadline"])
def test_a_newcomer_is_admitted_at_an_outer_step_and_takes_up_the_anchor(master, tmp_path, variant):
    # Peers 0 and 1 found the run; peer 2 connects after their outer step 4 and their next outer
    # step admits it (peers_pending, update_topology, a sync of anchor, momentum and count). With
    # a deadline no peers_pending vote is cast: the outer all-reduce's decision says so.
    deadline = 10.0 if variant.endswith("deadline") else None
    results = run_peers(master, tmp_path, "diloco", 3, outer=14, late=2, pause=0.05, deadline=deadline,
                        **{"async": variant.startswith("async")})
    newcomer = results[2]["records"]
    joined_at = newcomer[0]["outer"]
    assert 4 < joined_at < 14 and newcomer[-1]["world"] == 3
    for outer in [*range(joined_at, 15), "final"]:
        hashes = {rec["hash"] for r in results for rec in r["records"] if rec["outer"] == outer}
        assert len(hashes) == 1, f"outer step {outer}: anchors differ"
    for r in results:
        assert r["errors"] == [] and r["after"] < 0.05 * r["before"], r


class _ScriptedComm:
    """A one-peer communicator whose all-reduces fail as scripted (an error to raise from a
    Work's wait, or None to succeed): AsyncDiLoCo's bookkeeping around a failed all-reduce, step
    by step. What the real failures do to peers and buffers is the process tests' above."""

    def __init__(self, failures):
        self.failures = list(failures)
        self.started = 0

    def all_reduce_async(self, tensor, op, tag):
        assert op == "avg"
        self.started += 1
        failure = self.failures.pop(0) if self.failures else None

        class Work:
            def wait(self):
                if failure is not None:
                    raise failure

        return Work()

    def peers_pending(self):
        return False

    def peers_pending_async(self):
        class Vote:
            def wait(self):
                return False

        return Vote()


def test_async_diloco_retries_an_all_reduce_that_timed_out_as_it_retries_a_lost_peer():
    """A retryable failure other than a lost peer (the all-reduce ran past its bound) once left the
    failed Work pending: every retry waited for it again and got a usage error. The retry must
    wait for a fresh all-reduce of the same buffer, and end where a run without the failure ends."""
    import torch

    from shoal import PeerLostError, ShoalTimeoutError
    from shoal.torch import AsyncDiLoCo

    def run(failures):
        comm = _ScriptedComm(failures)
        model = torch.nn.Linear(3, 1)
        torch.nn.init.constant_(model.weight, 1.0)
        torch.nn.init.constant_(model.bias, 0.0)
        diloco = AsyncDiLoCo(comm, model.parameters(), inner_steps=1, outer_momentum=0.5)
        errors = []
        for step in range(4):
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.1 * (step + 1))
            for _ in range(3):
                try:
                    diloco.outer_step()
                    break
                except (PeerLostError, ShoalTimeoutError) as e:
                    errors.append(type(e).__name__)
            else:
                raise AssertionError(f"outer step {step} failed on every retry: {errors}")
        diloco.finish()
        return [p.detach().clone() for p in model.parameters()], errors, comm.started

    clean, errors, started = run([])
    assert errors == [] and started == 4
    for failure in (ShoalTimeoutError("all_reduce did not finish within 1.0 s"), PeerLostError("lost peer#2")):
        params, errors, started = run([None, failure])
        assert errors == [type(failure).__name__], errors
        assert started == 5, "the failed all-reduce is started again, once"
        assert all(torch.equal(a, b) for a, b in zip(params, clean)), "the retry changed the result"


@pytest.mark.parametrize("variant", ["sync", "async"])
def test_a_late_peer_is_left_out_of_an_outer_step_and_its_work_counts_at_the_next(master, tmp_path, variant):
    """Peer 2 reaches outer step 2 two seconds late (the deadline is 0.6 s): the others average
    without it and go on (no admission vote waits for it), so by then they ran more; it skips
    ahead through those, applying their averages, every anchor stays identical, and its
    pseudo-gradient is averaged in at the next outer step it makes in time. Every inner step of
    peer ``i`` adds ``i + 1`` to each parameter and the outer step is plain SGD of step 1, so
    each outer step moves the anchor by the mean of its participants' work since they last took
    part: ``5 (i + 1)`` per compute phase, two phases for the late peer."""
    results = run_peers(master, tmp_path, "diloco_late", 3, timeout=120, outer=8, deadline=0.6, pause=0.05,
                        lag=2.0, slow=2, **{"async": variant == "async"})
    _replays(results, slow_index=2, variant=variant)


@pytest.mark.parametrize("variant", ["sync", "async"])
def test_a_peer_slow_at_every_outer_step_holds_nobody_up_and_its_work_counts(master, tmp_path, variant):
    """Peer 2 computes twice as long as the others at every outer step: with a deadline they go
    on without it; it skips ahead and meets them at their next outer step, so its work counts
    (every anchor replayed from who took part); the run ends together, finish() averaging in
    what was left."""
    results = run_peers(master, tmp_path, "diloco_late", 3, timeout=120, outer=10, deadline=0.1, pause=0.3,
                        lag=0.3, slow=2, every=True, **{"async": variant == "async"})
    included = _replays(results, slow_index=2, variant=variant)
    slow = next(r for r in results if r["index"] == 2)
    assert sum(slow["rank"] in inc for inc in included) >= 2, included


def _replays(results: list, slow_index: int, variant: str) -> list:
    """Checks a diloco_late run (see the test above): identical anchors, a late peer that
    skipped ahead, and every anchor replayed from the sets each outer step ran among. Returns
    those sets."""
    for outer in {rec["outer"] for r in results for rec in r["records"]}:
        anchors = {tuple(rec["anchor"]) for r in results for rec in r["records"] if rec["outer"] == outer}
        assert len(anchors) <= 1, f"outer step {outer}: anchors differ: {anchors}"
    steady = next(r for r in results if r["index"] == 0)
    slow = next(r for r in results if r["index"] == slow_index)
    # The late peer skipped ahead: one of its outer steps took up more than one of the run's.
    outers = [rec["outer"] for rec in slow["records"] if rec["outer"] != "final"]
    assert any(b - a > 1 for a, b in zip([0, *outers], outers)), outers
    # Each record's all-reduce: the one its outer step applied (AsyncDiLoCo's first applies none),
    # and finish's, one more (AsyncDiLoCo's finish applies two, the one in flight and its own:
    # left out here, its anchor only compared); the steady peer's name every one, in order.
    records = steady["records"] if variant == "sync" else steady["records"][1:-1]
    included = [rec["included"] for rec in records]
    assert any(len(inc) == len(results) - 1 and slow["rank"] not in inc for inc in included), included
    # The rounds at which each peer ended a compute phase with a call: every one for the steady
    # peers; the late peer's own (the round after the last its previous outer step took up).
    # (DiLoCo's finish() runs its own outer step: no compute ends there.)
    rounds = len(included) - (variant == "sync")
    calls = {r["rank"]: set(range(1, rounds + 1)) for r in results}
    calls[slow["rank"]] = {a + 1 for a in [0, *outers]} & calls[slow["rank"]]
    work = {r["rank"]: 5.0 * (r["index"] + 1) for r in results}
    last_in = {rank: 0 for rank in calls}
    expected, anchors = 0.0, []
    for round_, inc in enumerate(included, start=1):
        contributions = [work[rank] * sum(1 for c in calls[rank] if last_in[rank] < c <= round_) for rank in inc]
        expected += sum(contributions) / len(contributions)
        last_in.update({rank: round_ for rank in inc})
        anchors.append(expected)
    got = [rec["anchor"][0] for rec in records]
    assert got == pytest.approx(anchors), (got, anchors, included, outers)
    if variant == "sync":
        assert slow["records"][-1]["anchor"][0] == pytest.approx(anchors[-1]), "finish applies the last one"
    assert any(slow["rank"] in inc for inc in included[2:]), "the late peer's work counted after it was late"
    return included


@pytest.mark.parametrize("variant", ["sync", "async"])
def test_finish_with_a_deadline_ends_where_a_run_without_one_ends_when_no_work_was_late(master, variant):
    """finish() with a deadline takes one more outer step, to average in the work of peers left
    out since they last took part. Where no work was late it must end where a run without a
    deadline ends: a momentum step there once moved the anchor again (with nothing new behind it),
    and the digits run ended 0.05 worse for it."""
    import torch

    import shoal
    from shoal.torch import AsyncDiLoCo, DiLoCo

    def run(deadline):
        with shoal.Communicator(master.address) as comm:
            comm.connect(timeout=30)
            param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
            kind = AsyncDiLoCo if variant == "async" else DiLoCo
            diloco = kind(comm, [param], inner_steps=1, outer_lr=0.7, outer_momentum=0.9, deadline=deadline)
            diloco.join()
            for step in range(4):
                with torch.no_grad():
                    param.add_(1.0 + step)
                diloco.outer_step()
            diloco.finish()
            return param.detach().clone()

    without = run(None)
    assert not torch.equal(without, torch.zeros(4, dtype=torch.float64))
    assert torch.equal(run(5.0), without)
