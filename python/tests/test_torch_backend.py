"""shoal under ``torch.distributed``: processes started as ``torchrun`` starts them (the rendezvous
store in the launcher, ``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment) run
``torch_worker.py`` on the ``shoal`` backend, each checking every operation against a reference
it computes from every rank's inputs; DDP and FSDP2 train as on the gloo backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

WORKER = Path(__file__).with_name("torch_worker.py")


def launch(scenario: str, backend: str, world: int, timeout: float = 120,
           killed: frozenset[int] = frozenset()) -> list[dict]:
    """Runs ``world`` workers as torchrun would (its agent's store in this process) and returns
    what each printed; the ranks in ``killed`` must die of SIGKILL."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = clean_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world),
                         "TORCHELASTIC_USE_AGENT_STORE": "True"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, backend], env=env | {"RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if rank in killed:
            assert p.returncode == -9, f"rank {rank} was to be killed: {p.returncode}\n{err[-3000:]}"
            outs.append({})
            continue
        assert p.returncode == 0, f"rank {rank} of {scenario} on {backend}: exit {p.returncode}\n{err[-4000:]}"
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_operation_dtype_and_reduction_matches_the_reference(world: int) -> None:
    """all_reduce (every dtype, SUM/AVG/PRODUCT/MIN/MAX, 1 to 4099 elements), coalesced and async
    ones, broadcast, all_gather (list and into one tensor), reduce_scatter (both), reduce, gather,
    scatter, all_to_all (uneven, and single with splits), batch_isend_irecv (two sends of one tag
    meet their receives in order), send/recv with a tag, barrier, a non-contiguous tensor and two
    subgroups side by side."""
    outs = launch("ops", "shoal", world)
    assert all(o["checks"] == outs[0]["checks"] > 300 for o in outs), outs


def test_ddp_on_shoal_trains_as_on_gloo() -> None:
    """The same model, data and seeds under DDP (small buckets: several per step), no hook and no
    extra group: every rank's parameters after 8 steps are those of the gloo run."""
    ours, gloo = launch("ddp", "shoal", 2), launch("ddp", "gloo", 2)
    assert ours[0] == ours[1], "DDP keeps the ranks identical"
    for a, b in zip(ours[0]["params"], gloo[0]["params"]):
        assert a == pytest.approx(b, abs=1e-12)


def test_pipelining_schedules_run_over_send_and_recv() -> None:
    """``torch.distributed.pipelining``'s GPipe and 1F1B over three stages: every stage's gradients
    and the loss are those of the same model run in one process."""
    outs = launch("pipeline", "shoal", 3)
    assert all(o == {"ScheduleGPipe": "ok", "Schedule1F1B": "ok"} for o in outs), outs


@pytest.mark.parametrize(("scenario", "world"), [("fsdp", 2), ("hsdp", 4)])
def test_fsdp2_trains_as_on_gloo(scenario: str, world: int) -> None:
    """FSDP2's ``fully_shard`` on a CPU mesh, and HSDP (sharded within pairs, replicated across
    them: both dimensions shoal subgroups): the parameters of the gloo run."""
    ours, gloo = launch(scenario, "shoal", world), launch(scenario, "gloo", world)
    for a, b in zip(ours[0]["params"], gloo[0]["params"]):
        assert a == pytest.approx(b, abs=1e-6)


def test_a_lost_rank_fails_the_call_retryably_and_the_retry_runs_without_it() -> None:
    """A rank SIGKILLed: the others' ``dist.all_reduce`` raises ``PeerLostError`` (shoal's, and
    torch's ``DistBackendError``) with their tensor as it was; called again as is, it sums the
    ranks left."""
    outs = launch("lost", "shoal", 3, killed=frozenset({2}))
    for o in outs[:2]:
        assert o["errors"] and set(o["errors"]) == {"PeerLostError"}, o
        assert o["sum"] == 1.0 + 2.0, o
