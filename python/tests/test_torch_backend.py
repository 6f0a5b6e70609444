"""shoal under ``torch.distributed``: processes started as ``torchrun`` starts them (the rendezvous
store in the launcher, ``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment) run
``torch_worker.py`` on the ``shoal`` backend, each checking every operation against a reference
it computes from every rank's inputs; DDP and FSDP2 train as on the gloo backend."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from conftest import clean_env

import shoal

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

WORKER = Path(__file__).with_name("torch_worker.py")


def launch(scenario: str, backend: str, world: int, timeout: float = 120,
           killed: frozenset[int] = frozenset(), env: "dict[str, str] | None" = None) -> list[dict]:
    """Runs ``world`` workers as torchrun would (its agent's store in this process), ``env``
    added to their environment, and returns what each printed; the ranks in ``killed`` must die
    of SIGKILL."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = clean_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world),
                         "TORCHELASTIC_USE_AGENT_STORE": "True"} | (env or {})
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


@pytest.mark.parametrize("world,compiled", [(2, True), (3, True), (4, True), (2, False)],
                         ids=["2", "3", "4", "2-python"])
def test_every_operation_dtype_and_reduction_matches_the_reference(world: int, compiled: bool) -> None:
    """all_reduce (every dtype, SUM/AVG/PRODUCT/MIN/MAX, 1 to 4099 elements), coalesced and async
    ones, broadcast, all_gather (list and into one tensor), reduce_scatter (both), reduce, gather,
    scatter, all_to_all (uneven, and single with splits), batch_isend_irecv (two sends of one tag
    meet their receives in order), send/recv with a tag, barrier, a non-contiguous tensor and two
    subgroups side by side. With the backend's compiled part, and once without it."""
    outs = launch("ops", "shoal", world, env={} if compiled else {"SHOAL_TORCH_COMPILED": "0"})
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


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_lost_rank_fails_the_call_retryably_and_the_retry_runs_without_it(compiled: bool) -> None:
    """A rank SIGKILLed, then another: the others' ``dist.all_reduce``, asynchronous the first
    time and blocking the second, raises ``PeerLostError`` (shoal's, and torch's
    ``DistBackendError``) with their tensor as it was; called again as is, it sums the ranks
    left. With the backend's compiled part and without it (``SHOAL_TORCH_COMPILED=0``)."""
    env = {} if compiled else {"SHOAL_TORCH_COMPILED": "0"}
    outs = launch("lost", "shoal", 4, killed=frozenset({2, 3}), env=env)
    for o in outs[:2]:
        assert o["compiled"] is compiled, o
        assert o["errors"] and set(o["errors"]) == {"PeerLostError"}, o
        assert o["sum"] == 1.0 + 2.0 + 3.0, o
        assert o["blocking_errors"] and set(o["blocking_errors"]) == {"PeerLostError"}, o
        assert o["sum_after"] == 1.0 + 2.0, o


def test_without_a_compiler_the_backend_runs_in_python_and_says_so(tmp_path: Path) -> None:
    """Where the compiled part cannot be built (here: a compiler that always fails, a cache of
    its own), importing the backend still works, warns once, and its base class is Python's."""
    env = clean_env() | {"XDG_CACHE_HOME": str(tmp_path), "CXX": "false"}
    probe = "from shoal import _c10d; print(_c10d.ShoalBackend.compiled)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-3000:]
    assert out.stderr.count("the torch backend runs in Python alone") == 1, out.stderr[-3000:]


def test_old_builds_of_the_compiled_part_are_pruned_but_those_in_use(tmp_path: Path) -> None:
    """Each new source, torch or Python version builds anew: the cache keeps the build in use and
    the most recently used others, never removes one a process is building, and does not trip on
    one another process removes meanwhile."""
    import fcntl

    from shoal import _c10d

    builds = [tmp_path / f"torch-backend-{k}" for k in range(6)]
    for k, build in enumerate(builds):
        build.mkdir()
        (build / "shoal.lock").touch()
        os.utime(build, (1000 + k, 1000 + k))  # torch-backend-5 the newest
    (tmp_path / "something-else").mkdir()
    # One another process removed while this one lists them (every process of a torchrun prunes).
    (tmp_path / "torch-backend-gone").symlink_to(tmp_path / "nowhere")
    with open(builds[0] / "shoal.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the oldest, being built
        _c10d._prune_builds(str(builds[1]))
    kept = sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink())
    assert kept == ["something-else", "torch-backend-0", "torch-backend-1", "torch-backend-4", "torch-backend-5"]
    assert _c10d.KEPT_BUILDS == 3


EXAMPLE = Path(__file__).parents[2] / "examples" / "torchrun_elastic.py"


class Torchrun:
    """One ``torchrun --standalone --nproc-per-node 1`` of the elastic example, its events read
    as they come."""

    def __init__(self, env: dict, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc-per-node", "1", str(EXAMPLE), *args],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    self.events.put(json.loads(line))

    def until(self, check: "Callable[[dict], bool]", timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            self.seen.append(event)
            if check(event):
                return event


def elastic_run(master: str, churn: bool, tmp_path: Path, steps: int = 150) -> "list[Torchrun]":
    """Three founders (a torchrun each); with ``churn``, the third is SIGKILLed at step 30 and a
    newcomer, started ahead, connects then. Returns every torchrun once each ended."""
    env = clean_env() | {"SHOAL_MASTER": master}
    args = ["--steps", str(steps), "--pause", "0.02"]
    founders = [Torchrun(env | {"SHOAL_MIN_WORLD_SIZE": "3"}, *args) for _ in range(3)]
    runs = list(founders)
    if churn:
        go = tmp_path / "go"
        runs.append(Torchrun(env, *args, "--wait-for", str(go)))
        victim = founders[2].until(lambda e: e["event"] == "started")["pid"]
        founders[0].until(lambda e: e["event"] == "step" and e["step"] >= 30)
        os.kill(victim, signal.SIGKILL)
        go.touch()
    for r in runs:
        r.proc.wait(timeout=120)
    return runs


def test_a_torchrun_ddp_run_survives_a_kill_and_a_newcomer_and_ends_at_the_loss_of_the_run_without(
        master: "shoal.Master", tmp_path: Path) -> None:
    """examples/torchrun_elastic.py, a DDP program whose step runs through ``Elastic``: three
    founders, each its own torchrun; one SIGKILLed at step 30, a newcomer started then joins at
    an admission step and takes up the run's state. Every survivor ends at the same step with
    bit-identical parameters, and the held-out loss is within the tolerance test_train.py allows
    churn (1.25x the clean run's)."""
    def done(run: Torchrun) -> dict:
        return run.until(lambda e: e["event"] == "done")

    clean = [done(r) for r in elastic_run(master.address, False, tmp_path)]
    assert len({e["hash"] for e in clean}) == 1 and {e["world"] for e in clean} == {3}, clean
    churned_runs = elastic_run(master.address, True, tmp_path)
    assert churned_runs[2].proc.returncode != 0, "the killed founder's torchrun failed"
    survivors = [churned_runs[i] for i in (0, 1, 3)]
    churned = [done(r) for r in survivors]
    assert len({e["hash"] for e in churned}) == 1 and {e["step"] for e in churned} == {150}, churned
    joined = next(e for e in churned_runs[3].seen if e["event"] == "started")
    assert 30 <= joined["step"] < 150 and joined["step"] % 5 == 0, joined
    # Three founders, one killed, one newcomer: the three that end are the run's world.
    assert {e["world"] for e in churned} == {3}, churned
    assert clean[0]["loss"] < 0.4 and churned[0]["loss"] <= 1.25 * clean[0]["loss"], (churned[0], clean[0])
