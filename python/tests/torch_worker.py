"""One process of a ``torch.distributed`` program on the ``shoal`` backend (or on gloo, to compare),
started as ``torchrun`` starts its workers: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment. ``python torch_worker.py SCENARIO BACKEND`` prints one line of
JSON with what the scenario found; a failed check raises.

Every scenario's inputs are functions of (rank, step), so each process computes the reference of
every operation itself, from every rank's inputs, in one process, as torch's own tests do."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

import shoal._c10d
import shoal.torch  # noqa: F401 - registers the backend

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
INTS = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPS: "dict[str, Any]" = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "prod": dist.ReduceOp.PRODUCT,
                         "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small values (1 to 3), so every reduction is exact in every dtype."""
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 5 + salt) % 3 + 1).to(dtype)


def reference(op: str, xs: "list[torch.Tensor]", dtype: torch.dtype) -> torch.Tensor:
    wide = torch.stack([x.to(torch.float64) for x in xs])
    out = {"sum": wide.sum(0), "avg": wide.mean(0), "prod": wide.prod(0), "min": wide.min(0).values,
           "max": wide.max(0).values}[op]
    return out.to(dtype)


def same(got: torch.Tensor, want: torch.Tensor, what: str, exact: bool = True) -> None:
    ok = torch.equal(got, want) if exact else torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2)
    if not ok:
        raise AssertionError(f"rank {RANK}: {what}: got {got[:8].tolist()}, want {want[:8].tolist()}")


def every_operation() -> "dict[str, Any]":
    """Every c10d operation the backend implements, every dtype, every reduction, checked against
    the reference; async ones through their Work (``wait``, ``is_completed``, ``get_future``)."""
    checks = 0
    ranks = range(WORLD)
    for dtype in INTS + FLOATS:
        for n in (1, 13, 4099):
            for name, op in OPS.items():
                if name == "avg" and not dtype.is_floating_point:
                    continue
                t = data(RANK, n, dtype)
                dist.all_reduce(t, op=op)
                same(t, reference(name, [data(r, n, dtype) for r in ranks], dtype), f"all_reduce {name} {dtype} {n}",
                     exact=name != "avg")
                checks += 1
        n = 11
        t = data(RANK, n, dtype)
        work = dist.all_reduce(t, async_op=True)
        future = work.get_future()
        work.wait()
        assert work.is_completed() and future.wait()[0].data_ptr() == t.data_ptr()
        same(t, reference("sum", [data(r, n, dtype) for r in ranks], dtype), f"async all_reduce {dtype}")
        pair = [data(RANK, 5, dtype, 1), data(RANK, 9, dtype, 2)]
        dist.all_reduce_coalesced(pair, op=dist.ReduceOp.MAX)
        for x, salt in zip(pair, (1, 2)):
            same(x, reference("max", [data(r, x.numel(), dtype, salt) for r in ranks], dtype), f"coalesced {dtype}")

        root = WORLD - 1
        b = data(RANK, n, dtype)
        dist.broadcast(b, src=root)
        same(b, data(root, n, dtype), f"broadcast {dtype}")

        outs = [torch.empty(n, dtype=dtype) for _ in ranks]
        dist.all_gather(outs, data(RANK, n, dtype))
        for r in ranks:
            same(outs[r], data(r, n, dtype), f"all_gather {dtype}")
        flat = torch.empty(WORLD * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, data(RANK, n, dtype))
        same(flat, torch.cat([data(r, n, dtype) for r in ranks]), f"all_gather_into_tensor {dtype}")

        full = WORLD * n
        rs = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(rs, data(RANK, full, dtype), op=dist.ReduceOp.MIN)
        want = reference("min", [data(r, full, dtype) for r in ranks], dtype)[RANK * n:(RANK + 1) * n]
        same(rs, want, f"reduce_scatter_tensor {dtype}")
        rs_list = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(rs_list, list(data(RANK, full, dtype).chunk(WORLD)))
        want = reference("sum", [data(r, full, dtype) for r in ranks], dtype)[RANK * n:(RANK + 1) * n]
        same(rs_list, want, f"reduce_scatter {dtype}")

        red = data(RANK, n, dtype)
        dist.reduce(red, dst=1 % WORLD, op=dist.ReduceOp.PRODUCT)
        want = data(RANK, n, dtype)
        if RANK == 1 % WORLD:
            want = reference("prod", [data(r, n, dtype) for r in ranks], dtype)
        same(red, want, f"reduce {dtype} (the others' input untouched)")
        even = data(RANK, 12, dtype)  # parts of equal size on 2, 3 and 4 ranks: none padded
        dist.reduce(even, dst=0, op=dist.ReduceOp.MAX)
        want = reference("max", [data(r, 12, dtype) for r in ranks], dtype) if RANK == 0 else data(RANK, 12, dtype)
        same(even, want, f"reduce {dtype} of equal parts")

        gathered = [torch.empty(n, dtype=dtype) for _ in ranks] if RANK == 0 else None
        dist.gather(data(RANK, n, dtype), gathered, dst=0)
        if gathered is not None:
            for r in ranks:
                same(gathered[r], data(r, n, dtype), f"gather {dtype}")
        part = torch.empty(n, dtype=dtype)
        dist.scatter(part, [data(r, n, dtype, 3) for r in ranks] if RANK == root else None, src=root)
        same(part, data(RANK, n, dtype, 3), f"scatter {dtype}")

        got = [torch.empty(r + 1, dtype=dtype) for r in ranks]
        dist.all_to_all(got, [data(RANK, RANK + 1, dtype, r) for r in ranks])  # to rank r, salted r
        for r in ranks:
            same(got[r], data(r, r + 1, dtype, RANK), f"all_to_all {dtype}")
        splits_in = [r + 1 for r in ranks]  # rank r gets r + 1 rows from each
        splits_out = [RANK + 1] * WORLD
        a2a = torch.empty(sum(splits_out), 2, dtype=dtype)
        dist.all_to_all_single(a2a, data(RANK, 2 * sum(splits_in), dtype).view(-1, 2), splits_out, splits_in)
        want = torch.cat([data(r, 2 * sum(splits_in), dtype).view(-1, 2)[sum(splits_in[:RANK]):][:RANK + 1]
                          for r in ranks])
        same(a2a, want, f"all_to_all_single {dtype}")

        nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
        inbox = [torch.empty(n, dtype=dtype) for _ in range(2)]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, data(RANK, n, dtype, 4), nxt),
                                        dist.P2POp(dist.isend, data(RANK, n, dtype, 5), nxt),
                                        dist.P2POp(dist.irecv, inbox[0], prv),
                                        dist.P2POp(dist.irecv, inbox[1], prv)])
        for w in works:
            w.wait()
        same(inbox[0], data(prv, n, dtype, 4), f"batch_isend_irecv {dtype}: the first send meets the first recv")
        same(inbox[1], data(prv, n, dtype, 5), f"batch_isend_irecv {dtype}")
        if RANK == 0:
            dist.send(data(RANK, n, dtype, 6), dst=WORLD - 1, tag=7)
        elif RANK == WORLD - 1:
            x = torch.empty(n, dtype=dtype)
            dist.recv(x, src=0, tag=7)
            same(x, data(0, n, dtype, 6), f"send/recv {dtype}")
        checks += 14
    dist.barrier()

    # recv without src: every other rank sends rank 0 two tensors with one tag; rank 0 takes them
    # as they come, each rank's in the order it sent them, and torch names the sender. Without the
    # compiled part (torch's own holder cannot name it) the call says so.
    if shoal._c10d.ShoalBackend.compiled:
        if RANK == 0:
            got: dict[int, list[float]] = {r: [] for r in ranks[1:]}
            for _ in range(2 * (WORLD - 1)):
                x = torch.empty(5)
                got[dist.recv(x, tag=11)].append(x[0].item())
            assert got == {r: [10.0 * r, 10.0 * r + 1] for r in ranks[1:]}, got
        else:
            for k in range(2):
                dist.send(torch.full((5,), 10.0 * RANK + k), dst=0, tag=11)
    elif RANK == 0:
        try:
            dist.recv(torch.empty(5), tag=11)
            raise AssertionError("recv without src ran without the compiled part")
        except Exception as e:  # noqa: BLE001 - whatever torch makes of the backend's UsageError
            assert "compiled part" in str(e), e
    checks += 1
    dist.barrier()

    # A non-contiguous tensor, reduced and gathered where it is.
    strided = torch.stack([data(RANK, 6, torch.float32), torch.zeros(6)], 1)[:, 0]
    dist.all_reduce(strided)
    same(strided, reference("sum", [data(r, 6, torch.float32) for r in ranks], torch.float32), "strided all_reduce")
    # A subgroup of the first and last ranks, and one of the others, side by side.
    ends = dist.new_group([0, WORLD - 1])
    middle = dist.new_group(list(range(1, WORLD - 1))) if WORLD > 2 else None
    if RANK in (0, WORLD - 1):
        e = data(RANK, 7, torch.float32)
        dist.all_reduce(e, group=ends)
        same(e, data(0, 7, torch.float32) + data(WORLD - 1, 7, torch.float32), "subgroup all_reduce")
        assert dist.get_rank(ends) == (0 if RANK == 0 else 1)
    elif middle is not None:
        m = torch.ones(3)
        dist.all_reduce(m, group=middle)
        same(m, torch.full((3,), float(WORLD - 2)), "the other subgroup")
    checks += 2
    # Leaving re-forms the run's group, failing what the others still run (retryably): the
    # subgroups' calls end before any process goes.
    dist.barrier()
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    except ValueError as e:
        assert "BAND" in str(e), e
    else:
        raise AssertionError("BAND is refused before any traffic")
    return {"checks": checks}


def ddp(steps: int = 8) -> "dict[str, Any]":
    """A small model trained with DDP, the same data on either backend: the final parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()
    torch.manual_seed(100 + RANK)  # only rank 0's initial weights count: DDP broadcasts them
    for p in model.parameters():
        p.data.add_(torch.randn_like(p) * 0.01 * RANK)
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(RANK)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g).double(), torch.randn(8, 4, generator=g).double()
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return {"params": [p.detach().reshape(-1).tolist() for p in model.parameters()]}


def pipeline(microbatches: int = 4) -> "dict[str, Any]":
    """``torch.distributed.pipelining``: one stage per rank, GPipe then 1F1B, over send/recv."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(WORLD)]
    stage_module = layers[RANK]
    losses: "list[float]" = []
    out: "dict[str, Any]" = {}
    for schedule_class in (ScheduleGPipe, Schedule1F1B):
        stage = PipelineStage(stage_module, RANK, WORLD, torch.device("cpu"))
        loss_fn: Callable[..., torch.Tensor] = torch.nn.functional.mse_loss
        schedule = schedule_class(stage, microbatches, loss_fn=loss_fn)
        x = torch.arange(microbatches * 2 * 8, dtype=torch.float32).view(-1, 8) / 100
        target = torch.zeros(microbatches * 2, 8)
        stage_module.zero_grad()
        if RANK == 0:
            schedule.step(x)
        elif RANK == WORLD - 1:
            losses = []
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        # The same model run in one process: the reference of the loss and of this stage's grads.
        ref = [torch.nn.Linear(8, 8) for _ in range(WORLD)]
        for r, layer in zip(ref, layers):
            r.load_state_dict(layer.state_dict())
        total = torch.zeros(())
        for xb, tb in zip(x.chunk(microbatches), target.chunk(microbatches)):
            h = xb
            for r in ref:
                h = r(h)
            loss = loss_fn(h, tb)
            (loss / microbatches).backward()  # the schedule scales the grads by the microbatches
            total = total + loss.detach()
        for p, rp in zip(stage_module.parameters(), ref[RANK].parameters()):
            assert p.grad is not None and torch.allclose(p.grad, rp.grad, atol=1e-6), f"{schedule_class.__name__}"
        if RANK == WORLD - 1:
            assert torch.allclose(sum(losses), total, atol=1e-6), (losses, total)
        out[schedule_class.__name__] = "ok"
    return out


def fsdp(steps: int = 3, hybrid: bool = False) -> "dict[str, Any]":
    """FSDP2 ``fully_shard`` on a CPU mesh (``hybrid``: HSDP, sharded within pairs of ranks and
    replicated across them): the parameters after a few steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if hybrid:
        mesh = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(RANK)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {"params": [p.full_tensor().reshape(-1).tolist() for p in model.parameters()]}


def lost() -> "dict[str, Any]":
    """The last rank is SIGKILLed after a barrier: the others' asynchronous all-reduce fails with
    shoal's ``PeerLostError`` (also torch's ``DistBackendError``), their tensor as it was, and the
    same call again runs over the ranks left. Then the next-to-last rank is: the others' blocking
    all-reduce (which the compiled part runs, where it is built) fails and is retried alike."""
    import signal

    import shoal

    def expect_lost(e: BaseException, t: torch.Tensor) -> str:
        assert isinstance(e, dist.DistBackendError), type(e).__mro__
        assert torch.equal(t, torch.full((1000,), float(RANK + 1))), "the tensor is as it was"
        return type(e).__name__

    def retry(t: torch.Tensor, errors: "list[str]") -> None:
        while True:
            try:
                dist.all_reduce(t)
                return
            except shoal.PeerLostError as e:
                errors.append(expect_lost(e, t))

    dist.barrier()
    if RANK == WORLD - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.full((1000,), float(RANK + 1))
    errors: "list[str]" = []
    # The first try as torch's async Work: wait() raises, and the Work says it ended with that.
    work = dist.all_reduce(t, async_op=True)
    try:
        work.wait()
    except shoal.PeerLostError as e:
        assert work.is_completed() and type(work.exception()) is type(e), (work.is_completed(), work.exception())
        errors.append(expect_lost(e, t))
        retry(t, errors)
    first = t[0].item()

    dist.barrier()
    if RANK == WORLD - 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.full((1000,), float(RANK + 1))
    blocking: "list[str]" = []
    try:
        dist.all_reduce(t)
    except shoal.PeerLostError as e:
        blocking.append(expect_lost(e, t))
        retry(t, blocking)
    return {"errors": errors, "sum": first, "blocking_errors": blocking, "sum_after": t[0].item(),
            "compiled": dist.group.WORLD._get_backend(torch.device("cpu")).compiled}


SCENARIOS = {"ops": every_operation, "ddp": ddp, "pipeline": pipeline, "fsdp": fsdp,
             "hsdp": lambda: fsdp(hybrid=True), "lost": lost}

if __name__ == "__main__":
    scenario, backend = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend)
    try:
        result = SCENARIOS[scenario]()
    finally:
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    if backend == "gloo":
        # gloo's threads sometimes abort the interpreter's teardown ("terminate called without
        # an active exception", a plain gloo script does it too): the reference run ends here.
        os._exit(0)
