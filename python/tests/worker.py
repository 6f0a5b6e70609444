"""A peer process for the tests: ``worker.py SCENARIO JSON_SPEC``. Prints one JSON line."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import shoal

DTYPES = ["uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"]
OPS = ["sum", "avg", "prod", "min", "max"]
LEN = 1031  # awkward: not a multiple of any world size or chunk


def inputs(dtype: str, op: str, rank_seed: int) -> np.ndarray:
    """Small integer values, so sums and products are exact in every dtype and any order."""
    rng = np.random.default_rng(rank_seed * 1000 + DTYPES.index(dtype) * 10 + OPS.index(op))
    if op == "prod":
        values = rng.choice([1, 2, -1, -2] if np.dtype(dtype).kind != "u" else [1, 2], size=LEN)
    else:
        values = rng.integers(0 if np.dtype(dtype).kind == "u" else -10, 11, size=LEN)
    return values.astype(dtype)


def communicator(spec: dict, **options) -> shoal.Communicator:
    """The spec's communicator: to its master, in its peer group (``group``; 0 unless it names one)."""
    return shoal.Communicator(spec["master"], peer_group=spec.get("group", 0), **options)


def join_all(comm: shoal.Communicator, peers: int) -> None:
    """Admit newcomers until the group has ``peers`` members, all-reducing at every size."""
    while comm.group_world_size < peers:
        x = np.ones(4, np.float32)
        comm.all_reduce(x, op="sum")
        assert x[0] == comm.group_world_size, (x, comm.group_world_size)
        if comm.peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.02)


def matrix(spec: dict) -> dict:
    """Every dtype and op once; results saved for the test to compare."""
    comm = communicator(spec, connections=spec.get("connections"), chunk_bytes=spec.get("chunk_bytes"))
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    results = {}
    algorithms = set()
    for dtype in DTYPES:
        for op in OPS:
            x = inputs(dtype, op, spec["index"])
            info = comm.all_reduce(x, op=op, algorithm=spec.get("algorithm"))
            assert info.world_size == spec["peers"]
            results[f"{dtype}/{op}"] = x
            algorithms.add(info.algorithm)
    np.savez(spec["out"] + ".npz", **results)
    return {"rank": comm.rank, "peer_id": comm.peer_id, "world_size": comm.world_size,
            "algorithms": sorted(algorithms)}


def verbs(spec: dict) -> dict:
    """all_gather, reduce_scatter (every op), broadcast (both algorithms) and barrier over every
    dtype; results saved for the test to compare."""
    comm = communicator(spec, connections=2, chunk_bytes=4096)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    rank, n, results = comm.rank, spec["peers"], {}
    for dtype in DTYPES:
        x = inputs(dtype, "sum", rank)
        out = np.zeros(LEN * n, dtype)
        assert comm.all_gather(out, x, tag=1).world_size == n
        results[f"gather/{dtype}"] = out
        for op in OPS:
            inp = np.concatenate([inputs(dtype, op, rank * n + b) for b in range(n)])
            before = inp.copy()
            block = np.zeros(LEN, dtype)
            comm.reduce_scatter(block, inp, op=op, tag=2)
            assert inp.tobytes() == before.tobytes(), "reduce_scatter changed its input"
            results[f"scatter/{dtype}/{op}"] = block
        for algorithm in ("ring", "oneshot"):
            t = inputs(dtype, "sum", rank)
            info = comm.broadcast(t, root=n - 1, tag=3, algorithm=algorithm)
            assert info.algorithm == algorithm, info
            results[f"broadcast/{dtype}/{algorithm}"] = t
    comm.barrier(tag=4)
    # Every verb in flight at once, with an all-reduce: the same results as one by one.
    dtype = "float32"
    x, out, block = inputs(dtype, "sum", rank), np.zeros(LEN * n, dtype), np.zeros(LEN, dtype)
    inp = np.concatenate([inputs(dtype, "max", rank * n + b) for b in range(n)])
    t, r = inputs(dtype, "sum", rank), inputs(dtype, "sum", rank)
    works = [comm.all_gather_async(out, x, tag=10), comm.reduce_scatter_async(block, inp, op="max", tag=11),
             comm.broadcast_async(t, root=n - 1, tag=12), comm.barrier_async(tag=13),
             comm.all_reduce_async(r, op="sum", tag=14)]
    assert all(w.wait(timeout=60).world_size == n for w in works)
    assert out.tobytes() == results[f"gather/{dtype}"].tobytes()
    assert block.tobytes() == results[f"scatter/{dtype}/max"].tobytes()
    assert t.tobytes() == results[f"broadcast/{dtype}/ring"].tobytes()
    results["async/all_reduce"] = r
    np.savez(spec["out"] + ".npz", **results)
    return {"rank": rank}


def torch_tensors(spec: dict) -> dict:
    import torch

    comm = communicator(spec)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    out = {}
    for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]:
        t = torch.full((257,), spec["index"] + 1, dtype=dtype)
        before = t.data_ptr()
        comm.all_reduce(t, op="sum")
        assert t.data_ptr() == before  # in place
        out[str(dtype)] = t.float().tolist()[:3]
    # A tensor that requires grad: its storage is reduced in place.
    w = torch.ones(10, requires_grad=True)
    comm.all_reduce(w, op="avg")
    out["requires_grad"] = w.detach().tolist()[:2]
    # Quantized: a bfloat16 tensor in int8, and a float32 one through error feedback.
    g = torch.linspace(-1, 1, 1000, dtype=torch.bfloat16) * (spec["index"] + 1)
    comm.all_reduce(g, op="avg", quantization="int8")
    out["bf16_int8"] = g.float().tolist()
    ef, h = shoal.ErrorFeedback("int4"), torch.linspace(-1, 1, 1000) * (spec["index"] + 1)
    ef.all_reduce(comm, h, key="h")
    out["ef_int4"], out["ef_residual"] = h.tolist(), float(ef.residual("h").abs().max())
    return out


def join_late(spec: dict) -> dict:
    """Peer i arrives i * delay seconds late; the ones in keep all-reducing until all are in."""
    time.sleep(spec["index"] * spec["delay"])
    comm = communicator(spec)
    comm.connect(timeout=60)
    seen = [comm.group_world_size]
    while comm.group_world_size < spec["peers"]:
        x = np.full(100_000, 1.0, np.float32)
        comm.all_reduce(x, op="sum")
        assert (x == comm.group_world_size).all()
        if comm.peers_pending():
            comm.update_topology()
            seen.append(comm.group_world_size)
    x = np.arange(10, dtype=np.float64) * (spec["index"] + 1)
    comm.all_reduce(x, op="sum")
    return {"seen": seen, "result": x.tolist(), "rank": comm.rank}


def overlap(spec: dict) -> dict:
    """Many all-reduces in flight at once, of mixed sizes and dtypes, while the caller computes;
    a tag reused in flight is refused at once; then all_reduce_many. Checks every result."""
    comm = communicator(spec, timeout=60)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    rank, n = spec["index"], spec["peers"]
    sizes = [1, 1000, 1 << 18, 7, 1 << 20, 4096, 33, 1 << 16]
    tensors = [np.full(size, rank + 1 + i, np.float64) for i, size in enumerate(sizes)]
    works = [comm.all_reduce_async(t, op="sum", tag=i) for i, t in enumerate(tensors)]
    try:
        comm.all_reduce_async(np.ones(4, np.float32), op="sum", tag=3)
        reused = None
    except shoal.UsageError as e:
        reused = str(e)
    busy = sum(i * i for i in range(200_000))  # the caller's compute, overlapping
    infos = [w.wait() for w in works]
    for i, (t, info) in enumerate(zip(tensors, infos)):
        expected = sum(r + 1 + i for r in range(n))
        assert (t == expected).all(), (i, t[:3], expected)
        assert info.world_size == n and w_done(works[i])
    many = [np.full(1000 * (i + 1), rank + i, np.int64) for i in range(12)]
    infos = comm.all_reduce_many(many, op="sum", max_in_flight=4, tag=100)
    for i, t in enumerate(many):
        assert (t == sum(r + i for r in range(n))).all(), (i, t[:3])
    return {"reused": reused, "busy": busy > 0, "many": len(infos), "sequences": [i.sequence for i in infos]}


def w_done(work: shoal.Work) -> bool:
    return work.done()


def many_survive(spec: dict) -> dict:
    """all_reduce_many over batches while a peer is killed: every batch returns with every tensor
    reduced exactly once in the world it returned in."""
    comm = communicator(spec, timeout=60, heartbeat_timeout=spec.get("heartbeat_timeout"))
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    print(json.dumps({"ready": comm.peer_id}), flush=True)
    worlds, deadline = [], time.time() + 60
    while (not worlds or worlds[-1] == spec["peers"] or len(worlds) < 3) and time.time() < deadline:
        tensors = [np.ones(1 << 16, np.float32) for _ in range(8)]
        infos = comm.all_reduce_many(tensors, op="sum", max_in_flight=3)
        world = infos[0].world_size
        assert all(i.world_size == world for i in infos), [i.world_size for i in infos]
        assert all((t == world).all() for t in tensors), [t[:2] for t in tensors]
        worlds.append(world)
    return {"worlds": worlds}


def survive(spec: dict) -> dict:
    """All-reduce in a loop; on PeerLostError vote update_topology (or, with ``retry_only``, simply
    try again) and go on, until ``steps_after`` all-reduces succeeded in a smaller world. Prints
    "ready" once all are in. Reports every error and when the first smaller world succeeded."""
    comm = communicator(spec, timeout=60, listen_addr=spec.get("listen"),
                              advertise_addr=spec.get("advertise"), heartbeat_timeout=spec.get("heartbeat_timeout"))
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    print(json.dumps({"ready": comm.peer_id}), flush=True)
    errors, smaller, recovered_at, deadline = [], 0, None, time.time() + 60
    x = np.empty(spec.get("count", 1 << 20), np.float32)
    try:
        while smaller < spec["steps_after"] and time.time() < deadline:
            x[:] = 1.0
            try:
                info = comm.all_reduce(x, op="sum")
            except shoal.PeerLostError as e:
                errors.append({"at": time.time(), "error": str(e)})
                if not spec.get("retry_only"):
                    comm.update_topology()
                continue
            assert (x == info.world_size).all(), (x[:3], info.world_size)
            if info.world_size < spec["peers"]:
                smaller += 1
                recovered_at = recovered_at or time.time()
    except shoal.KickedError as e:
        return {"kicked": str(e)}
    except shoal.MasterUnreachableError as e:
        return {"master_unreachable": str(e)}
    return {"errors": errors, "world": comm.group_world_size, "smaller": smaller, "recovered_at": recovered_at,
            "lane_segments": lane_segments()}


def lane_segments() -> int:
    """How many shared-memory lane segments this process maps (distinct memfd inodes)."""
    with open("/proc/self/maps") as maps:
        return len({line.split()[4] for line in maps if "memfd:shoal-lane" in line})


def agree(spec: dict) -> dict:
    """All-reduce distinct data for ``steps`` steps and record each step's outcome: the result's
    hash, or the error and whether the buffer came back exactly as it was. A peer given
    ``failpoint`` arms it once everyone is in, and so dies at that step of its first all-reduce.
    On PeerLostError the others vote update_topology and go on."""
    comm = communicator(spec, timeout=60)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    print(json.dumps({"ready": comm.peer_id}), flush=True)
    if "failpoint" in spec:
        os.environ["SHOAL_FAILPOINT"] = spec["failpoint"]
    rng = np.random.default_rng(spec["index"])
    outcomes = []
    for step in range(spec["steps"]):
        x = rng.standard_normal(spec.get("count", 300_000)).astype(np.float32)
        before = x.tobytes()
        while True:  # a failed step is retried with the same data: it did not happen
            try:
                info = comm.all_reduce(x, op="sum")
                outcomes.append({"ok": True, "world": info.world_size, "step": step,
                                 "sha": hashlib.sha256(x.tobytes()).hexdigest(),
                                 "collective": [info.topology, info.sequence]})
                break
            except (shoal.PeerLostError, shoal.CollectiveMismatchError) as e:
                outcomes.append({"ok": False, "error": type(e).__name__, "step": step,
                                 "restored": x.tobytes() == before, "msg": str(e)})
                comm.update_topology()
    return {"outcomes": outcomes, "world": comm.group_world_size}


def min_world(spec: dict) -> dict:
    """Arrive ``index * delay`` seconds late; connect waits until everyone is in."""
    time.sleep(spec["index"] * spec["delay"])
    comm = communicator(spec)
    t0 = time.monotonic()
    comm.connect(timeout=30, min_world_size=spec["peers"])
    connect_s = time.monotonic() - t0
    world = comm.group_world_size
    x = np.ones(8, np.float32)
    comm.all_reduce(x, op="sum")
    return {"world": world, "sum": float(x[0]), "connect_s": connect_s}


def pipeline_dp(spec: dict) -> dict:
    """One process of a two-stage pipeline replicated twice (``index`` = replica * 2 + stage),
    written the obvious way: one communicator for its pipeline (send/recv), one for its stage's
    replicas (all-reduce), each connected in turn, then a few steps of both."""
    replica, stage = divmod(spec["index"], 2)
    pipe = shoal.Communicator(spec["master"], peer_group=200 + replica)
    dp = shoal.Communicator(spec["master"], peer_group=100 + stage)
    t0 = time.monotonic()
    pipe.connect(timeout=spec["connect_timeout"], min_world_size=2)
    dp.connect(timeout=spec["connect_timeout"], min_world_size=2)
    connected_s = time.monotonic() - t0
    other = 1 - pipe.rank
    grads = []
    for step in range(spec["steps"]):
        activation = np.full(16, replica * 10 + step, np.float32)
        grad = np.empty(16, np.float32)
        if stage == 0:
            pipe.send(activation, peer=other, tag=step)
            pipe.recv(grad, peer=other, tag=1000 + step)
        else:
            pipe.recv(activation, peer=other, tag=step)
            grad = activation * 2
            pipe.send(grad, peer=other, tag=1000 + step)
        info = dp.all_reduce(grad, op="sum")
        assert info.world_size == 2, info
        grads.append(float(grad[0]))
    sizes = [pipe.group_world_size, dp.group_world_size, dp.world_size]
    pipe.close()
    dp.close()
    return {"connected_s": connected_s, "grads": grads, "sizes": sizes}


def derived(spec: dict) -> dict:
    """One process of a two-stage pipeline replicated twice, all four in one communicator's group:
    each pipeline and each stage's replicas are groups derived from it with ``split`` (no new
    admission), then a few steps of both, and ``new_group`` of its first and last rank. With
    ``die``, process 3 kills itself while process 1, its stage's other replica, waits for it in
    an all-reduce: that fails as retryable, and the retry runs in the group of the one left."""
    comm = communicator(spec)
    comm.connect(timeout=30, min_world_size=spec["peers"])
    rank = comm.rank
    replica, stage = divmod(spec["index"], 2)
    pipe = comm.split(color=replica, key=stage)
    dp = comm.split(color=stage, key=replica)
    assert pipe is not None and dp is not None
    grads = []
    for step in range(spec["steps"]):
        activation = np.full(16, replica * 10 + step, np.float32)
        grad = np.empty(16, np.float32)
        if pipe.rank == 0:
            pipe.send(activation, peer=1, tag=step)
            pipe.recv(grad, peer=1, tag=1000 + step)
        else:
            pipe.recv(activation, peer=0, tag=step)
            grad = activation * 2
            pipe.send(grad, peer=0, tag=1000 + step)
        info = dp.all_reduce(grad, op="sum")
        assert info.world_size == 2, info
        grads.append(float(grad[0]))
    ends = comm.new_group([0, comm.group_world_size - 1])
    ends_sum = None
    if ends is not None:
        x = np.ones(4, np.float32)
        ends.all_reduce(x, op="sum")
        ends_sum = float(x[0])
    result = {"rank": rank, "grads": grads, "sizes": [pipe.group_world_size, dp.group_world_size],
              "ranks": [pipe.rank, dp.rank], "ends": ends_sum}
    if spec.get("die"):
        waiting, done = Path(spec["die"] + ".waiting"), Path(spec["die"] + ".done")
        if spec["index"] == 3:
            # Dies once its partner waits for it in the all-reduce it never joins.
            while not waiting.exists():
                time.sleep(0.01)
            os.kill(os.getpid(), 9)
        elif spec["index"] == 1:
            errors = []
            x = np.ones(4, np.float32)
            work = dp.all_reduce_async(x, op="sum")
            waiting.touch()
            while True:
                try:
                    info = work.wait()
                    break
                except shoal.PeerLostError as e:
                    errors.append(type(e).__name__)
                    x = np.ones(4, np.float32)
                    work = dp.all_reduce_async(x, op="sum")
            result["after"] = {"errors": errors, "world": info.world_size, "sum": float(x[0])}
            done.touch()
        else:
            # Stage 0 trains on meanwhile: its calls take up the topology the loss re-forms.
            while not done.exists():
                try:
                    dp.all_reduce(np.ones(4, np.float32), op="sum")
                except shoal.PeerLostError:
                    pass
                time.sleep(0.01)
    return result


def busy(spec: dict) -> dict:
    """Join (the group's members admitting each other), say so, then stay in the run without a
    call for ``busy`` seconds: alive, heartbeating, voting nothing."""
    comm = communicator(spec)
    comm.connect(timeout=30, min_world_size=spec["peers"])
    print("ready", flush=True)
    time.sleep(spec["busy"])
    return {"peer": comm.peer_id}


def master_loss(spec: dict) -> dict:
    """All-reduce until the master is lost; then every other call must fail the same way."""
    comm = communicator(spec, heartbeat_timeout=spec["heartbeat_timeout"], timeout=60)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    print(json.dumps({"ready": comm.peer_id}), flush=True)
    x = np.ones(1 << 16, np.float32)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            comm.all_reduce(x, op="max")
        except shoal.MasterUnreachableError as e:
            lost_at, first = time.time(), str(e)
            break
    else:
        return {"error": "never noticed"}
    later = {}
    for name, call in [("all_reduce", lambda: comm.all_reduce(x)), ("peers_pending", comm.peers_pending),
                       ("update_topology", comm.update_topology)]:
        started = time.time()
        try:
            call()
            later[name] = "returned"
        except shoal.ShoalError as e:
            later[name] = f"{type(e).__name__} after {time.time() - started:.2f} s"
    return {"at": lost_at, "first": first, "later": later}


def admission_misuse(spec: dict) -> dict:
    """Peer 0 calls update_topology while the others all-reduce: every one of them gets a
    UsageError naming the other call; then all vote together and the run goes on."""
    comm = communicator(spec, timeout=30)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    x = np.arange(1000, dtype=np.float32)
    if spec["index"] == 0:
        time.sleep(0.3)  # the others are in their all-reduce: one round of errors, not two
    started = time.time()
    try:
        if spec["index"] == 0:
            comm.update_topology()
        else:
            comm.all_reduce(x)
        error = None
    except shoal.ShoalError as e:
        error = {"type": type(e).__name__, "msg": str(e), "calls": getattr(e, "calls", None)}
    took = time.time() - started
    restored = bool((x == np.arange(1000, dtype=np.float32)).all())
    if spec["index"] == 0:
        # The voter had joined the re-formed topology before its vote was abandoned: pausing
        # lets that topology come into force between its calls, which the next call must take up
        # (it once ran in the old position on blocking streams, and hung).
        time.sleep(0.3)
    comm.update_topology()
    y = np.ones(10, np.float32)
    comm.all_reduce(y, op="sum")
    return {"error": error, "took": took, "restored": restored, "after": float(y[0])}


def die_at(spec: dict) -> dict:
    """The peer of index ``victim`` dies at ``failpoint``; the others make the call it names and
    then all-reduce until they succeed in the smaller world. Records what every call did."""
    point, victim = spec["failpoint"], spec["index"] == spec["victim"]
    comm = communicator(spec, timeout=30, chunk_bytes=spec.get("chunk_bytes"))
    if point.startswith("connect"):
        # The victim arrives last and dies while being admitted.
        if victim:
            os.environ["SHOAL_FAILPOINT"] = point
            comm.connect(timeout=30)
            raise AssertionError("the failpoint did not fire")
        comm.connect(timeout=30)
        join_all(comm, spec["peers"] - 1)
        print(json.dumps({"ready": comm.peer_id}), flush=True)
        while not comm.peers_pending():
            time.sleep(0.02)
    else:
        comm.connect(timeout=30)
        join_all(comm, spec["peers"])
        # A broadcast's root receives nothing, so never reaches a receiving failpoint: every peer
        # learns who the victim is and broadcasts from another.
        victims = np.zeros(spec["peers"], np.float32)
        comm.all_gather(victims, np.array([float(victim)], np.float32))
        root = int(np.flatnonzero(victims == 0)[0])
        print(json.dumps({"ready": comm.peer_id}), flush=True)
        if victim:
            os.environ["SHOAL_FAILPOINT"] = point
    calls = []
    size, verb = spec.get("size", 100_000), spec.get("verb")
    n = comm.group_world_size
    # The buffer the call writes: an all-gather's output, a reduce-scatter's, or the tensor itself.
    x = np.arange(size * n if verb == "all_gather" else size // n if verb == "reduce_scatter" else size,
                  dtype=np.float32)
    original = x.copy()
    started = time.time()
    first = point.split(".")[0]
    try:
        if first == "all_reduce" and verb == "broadcast":
            comm.broadcast(x, root=root, algorithm=spec.get("algorithm"))
        elif first == "all_reduce" and verb == "all_gather":
            comm.all_gather(x, np.ones(size, np.float32))
        elif first == "all_reduce" and verb == "reduce_scatter":
            comm.reduce_scatter(x, np.ones(size, np.float32))
        elif first == "all_reduce":
            comm.all_reduce(x, op="sum", algorithm=spec.get("algorithm"), quantization=spec.get("quantization"))
        elif first == "peers_pending":
            comm.peers_pending()
        elif first == "optimize_topology":
            comm.optimize_topology()
        else:
            comm.update_topology()
        calls.append({"call": first, "ok": True})
    except shoal.PeerLostError as e:
        restored = x.tobytes() == original.tobytes()
        calls.append({"call": first, "error": str(e), "restored": restored})
    calls[-1]["seconds"] = time.time() - started
    assert not victim, "the failpoint did not fire"
    for _ in range(3):
        y = np.ones(16, np.float32)
        try:
            info = comm.all_reduce(y, op="sum")
            calls.append({"call": "all_reduce", "ok": True, "world": info.world_size, "sum": float(y[0])})
            break
        except shoal.PeerLostError as e:
            calls.append({"call": "all_reduce", "error": str(e)})
            comm.update_topology()
    return {"calls": calls}


def sgd(spec: dict) -> dict:
    """Deterministic data-parallel SGD on a fixed least-squares problem. Every step: admit
    newcomers, sync the shared state (the newcomer, arriving with zeros, is repaired), all-reduce
    the gradient of this peer's shard, update. Records the state's hash after every sync."""
    if spec["index"] == spec["peers"] - 1:
        time.sleep(spec["late"])
    rng = np.random.default_rng(0)
    x_all = rng.standard_normal((400, 16)).astype(np.float32)
    y_all = x_all @ np.arange(16, dtype=np.float32)
    w = np.zeros(16, np.float32)
    momentum = np.zeros(16, np.float32)
    state = shoal.SharedState({"w": w, "momentum": momentum}, revision=0)
    comm = communicator(spec, timeout=30)
    comm.connect(timeout=30)
    newcomer = comm.world_size > 1
    records = []
    # Every peer sees the same revision and world, so all stop together: at `steps`, and not
    # before the latecomer is in.
    while state.revision < spec["steps"] or comm.world_size < spec["peers"]:
        if not newcomer and comm.peers_pending():
            comm.update_topology()
        newcomer = False
        state.revision += 1
        info = comm.sync_shared_state(state)
        records.append({"revision": state.revision, "hash": shoal.hash_tensor(w) + shoal.hash_tensor(momentum),
                        "world": comm.world_size, "received": sorted(info.received)})
        shard = slice(comm.rank * 100 % 400, comm.rank * 100 % 400 + 100)
        x, y = x_all[shard], y_all[shard]
        grad = (x.T @ (x @ w - y) / len(y)).astype(np.float32)
        comm.all_reduce(grad, op="avg")
        momentum *= 0.9
        momentum += grad
        w -= 0.01 * momentum
        time.sleep(0.01)
    return {"records": records, "loss": float(((x_all @ w - y_all) ** 2).mean())}


def restart_loop(spec: dict) -> dict:
    """The training loop users write, retrying what a lost peer or master interrupts: every step
    syncs the shared state at its revision, all-reduces this shard's gradient and updates. Writes
    each step's revision to ``out.step`` (the test kills the master partway); records each
    step's state hash and wall time, and every error."""
    rng = np.random.default_rng(0)
    x_all = rng.standard_normal((300, 16)).astype(np.float32)
    y_all = x_all @ np.arange(16, dtype=np.float32)
    w = np.zeros(16, np.float32)
    state = shoal.SharedState({"w": w}, revision=0)
    comm = communicator(spec, timeout=30, heartbeat_timeout=spec["heartbeat"])
    comm.connect(timeout=30)
    while comm.world_size < spec["peers"]:
        if comm.peers_pending():
            comm.update_topology()
    records, errors = [], []
    while state.revision < spec["steps"]:
        state.revision += 1
        shard = slice(comm.rank * 100, comm.rank * 100 + 100)
        grad = (x_all[shard].T @ (x_all[shard] @ w - y_all[shard]) / 100).astype(np.float32)
        try:
            comm.sync_shared_state(state)
            comm.all_reduce(grad, op="avg")
        except shoal.PeerLostError as e:
            errors.append({"type": type(e).__name__, "at": state.revision, "t": time.time(), "what": str(e)})
            state.revision -= 1
            continue
        w -= 0.02 * grad
        records.append({"revision": state.revision, "hash": shoal.hash_tensor(w), "world": comm.world_size,
                        "t": time.time()})
        with open(spec["out"] + ".step", "w") as f:
            f.write(str(state.revision))
        time.sleep(0.01)
    return {"peer_id": comm.peer_id, "records": records, "errors": errors}


def diloco(spec: dict) -> dict:
    """DiLoCo (or, with ``async``, AsyncDiLoCo) on a linear regression, each peer on its own
    shard: records the anchor's hash and the world at every outer step, the errors retried, and
    the loss of the anchor on a common set before and after. The peer of index ``victim`` kills
    itself at outer step 3."""
    import signal

    import torch

    from shoal.torch import AsyncDiLoCo, DiLoCo

    torch.manual_seed(0)  # the same initial model everywhere
    model = torch.nn.Linear(8, 1)
    truth = torch.arange(8, dtype=torch.float32)
    g = torch.Generator().manual_seed(100 + spec["index"])
    x = torch.randn(256, 8, generator=g)
    y = x @ truth + 0.5
    x_eval = torch.randn(512, 8, generator=torch.Generator().manual_seed(7))
    y_eval = x_eval @ truth + 0.5
    errors: list = []
    comm = communicator(spec, timeout=30)
    late = spec.get("late") == spec["index"]
    if late:  # connects once the founders are past outer step 3; their next outer step admits it
        while not os.path.exists(spec["out"].replace(f"peer{spec['index']}", "peer0") + ".outer4"):
            time.sleep(0.01)
    comm.connect(timeout=30)
    founders = spec["peers"] - ("late" in spec)
    while not late and comm.world_size < founders:
        if comm.peers_pending():
            comm.update_topology()
    kind = AsyncDiLoCo if spec["async"] else DiLoCo
    recipe = kind(comm, model.parameters(), inner_steps=5, outer_lr=0.7, outer_momentum=0.5,
                  quantization=spec.get("quantization"), deadline=spec.get("deadline"))
    def retried(call):  # a lost peer: the call changed nothing, and is made again
        while True:
            try:
                return call()
            except shoal.PeerLostError as e:
                errors.append(type(e).__name__)

    retried(recipe.join)

    def anchor_loss() -> float:
        w, b = recipe.anchor[:8], recipe.anchor[8:]
        return float(((x_eval @ w + b - y_eval) ** 2).mean())

    before = anchor_loss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records, i = [], 0
    while recipe.outer_steps < spec["outer"]:
        batch = slice(i * 32 % 256, i * 32 % 256 + 32)
        i += 1
        opt.zero_grad()
        loss = ((model(x[batch]).squeeze(-1) - y[batch]) ** 2).mean()
        loss.backward()
        opt.step()
        if spec.get("victim") == spec["index"] and recipe.outer_steps == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if retried(recipe.step):
            records.append({"outer": recipe.outer_steps, "hash": shoal.hash_tensor(recipe.anchor),
                            "world": comm.world_size})
            open(f"{spec['out']}.outer{recipe.outer_steps}", "w").close()
            time.sleep(spec.get("pause", 0))
    retried(recipe.finish)
    records.append({"outer": "final", "hash": shoal.hash_tensor(recipe.anchor), "world": comm.world_size})
    return {"records": records, "errors": errors, "before": before, "after": anchor_loss()}


def ddp(spec: dict) -> dict:
    """A DistributedDataParallel MLP whose buckets shoal.torch.DDPHook averages: each peer on its
    own shard, records the parameters' hash after every step and the errors retried; the peer of
    index ``victim`` kills itself at step 5."""
    import signal

    import torch
    import torch.distributed as dist

    from shoal.torch import DDPHook

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    g = torch.Generator().manual_seed(100 + spec["index"])
    x = torch.randn(256, 8, generator=g)
    y = 0.5 * x[:, 0] - 0.25 * x[:, 1]
    comm = communicator(spec, timeout=30)
    comm.connect(timeout=30)
    while comm.world_size < spec["peers"]:
        if comm.peers_pending():
            comm.update_topology()
    hook = DDPHook(comm)
    hook.register(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records, errors, losses = [], [], []
    for step in range(spec["steps"]):
        if spec.get("victim") == spec["index"] and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        batch = slice(step * 32 % 256, step * 32 % 256 + 32)
        while True:
            opt.zero_grad()
            loss = ((net(x[batch]).squeeze(-1) - y[batch]) ** 2).mean()
            loss.backward()
            try:
                hook.check()
                break
            except shoal.PeerLostError as e:
                errors.append(type(e).__name__)
        opt.step()
        losses.append(float(loss))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        records.append({"step": step, "hash": shoal.hash_tensor(flat), "world": comm.world_size})
    dist.destroy_process_group()
    return {"records": records, "errors": errors, "first": losses[0], "last": sum(losses[-5:]) / 5}


def sync_case(spec: dict) -> dict:
    """One sync among ``peers`` peers whose states and strategies ``case`` sets by index."""
    case, i = spec["case"], spec["index"]
    comm = communicator(spec, timeout=30)
    comm.connect(timeout=30, min_world_size=spec["peers"])
    strategy = "enforce_popular"
    if case in ("send_only", "receive_only") and i == 0:
        strategy = case
    if case == "dtypes":
        import torch

        tensors = {d: (np.arange(300).reshape(3, 100) % 11 + (i == 2)).astype(d) for d in DTYPES}
        tensors["torch.bf16"] = torch.arange(50, dtype=torch.bfloat16) + (i == 2)
        tensors["scalar"] = np.array(float(i == 2))
    elif case == "donor_dies":
        tensors = {"big": np.full(spec["mib"] << 18, 0.0 if i == 2 else 1.5, np.float32)}
        if i == 0:
            os.environ["SHOAL_FAILPOINT"] = "sync.serve"
    else:
        # Peer 0 differs from the two others.
        tensors = {"w": np.full(1000, 7.0 if i == 0 else 1.0, np.float32), "step": np.array([3], np.int64)}
    state = shoal.SharedState(tensors, revision=spec.get("revision", 0))
    try:
        info = comm.sync_shared_state(state, strategy)
        result = {"received": info.received, "sent_to": info.sent_to, "revision": info.revision}
    except shoal.ShoalError as e:
        result = {"error": type(e).__name__, "msg": str(e)}
    result["hashes"] = state.hashes()
    result["peer_id"] = comm.peer_id
    return result


def repairs(spec: dict) -> dict:
    """``rounds`` syncs in each of which peer 0's small tensor differs from the others': it is
    repaired every time. Returns who delivered it each time."""
    comm = communicator(spec, timeout=30)
    comm.connect(timeout=30, min_world_size=spec["peers"])
    w = np.ones(1000, np.float32)
    state = shoal.SharedState({"w": w})
    donors = []
    for revision in range(spec["rounds"]):
        if spec["index"] == 0:
            w[:] = -1.0
        state.revision = revision
        donors.append(comm.sync_shared_state(state).received.get("w", []))
    return {"peer_id": comm.peer_id, "donors": donors, "hashes": state.hashes()}


def mismatch(spec: dict) -> dict:
    """The peer of index 1 first calls all_reduce with another count (or dtype, op, tag or
    quantization, as ``vary`` says); every peer retries its call until it succeeds (the odd one now matching),
    then all run one more. A peer that had not started the mismatched collective when it was
    aborted joins the re-formed ring directly and sees no error: the call did not happen."""
    comm = communicator(spec, timeout=30)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    error, attempt = None, 0
    while True:
        odd = spec["index"] == 1 and attempt == 0
        x = np.arange(10 + (spec["vary"] == "count" and odd),
                      dtype=np.float64 if spec["vary"] == "dtype" and odd else np.float32)
        before = x.tobytes()
        op = "max" if spec["vary"] == "op" and odd else "sum"
        tag = 1 if spec["vary"] == "tag" and odd else 0
        attempt += 1
        try:
            comm.all_reduce(x, op=op, tag=tag, quantization="int8" if spec["vary"] == "quantization" and odd else None)
            break
        except shoal.ShoalError as e:
            error = {"type": type(e).__name__, "msg": str(e), "restored": x.tobytes() == before, "count": len(x)}
            if not spec.get("retry_only"):
                comm.update_topology()
    y = np.ones(10, np.float32)
    comm.all_reduce(y, op="sum")
    return {"error": error, "after": float(y[0]), "me": comm.peer_id, "odd": spec["index"] == 1}


def late_misuse(spec: dict) -> dict:
    """Every peer calls broadcast from a root outside the group, the peer of index ``late`` 0.5 s
    after the others (their calls failed by then); then all call a correct all_reduce. Each
    broadcast must fail with UsageError, the late one's too, and the all_reduce succeed on every
    peer: a usage error never outlives its call."""
    comm = communicator(spec, timeout=20)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    if spec["index"] == spec["late"]:
        time.sleep(0.5)
    t = np.ones(4, np.float32)
    try:
        comm.broadcast(t, root=99)
        broadcast = None
    except shoal.ShoalError as e:
        broadcast = {"type": type(e).__name__, "msg": str(e)}
    start = time.monotonic()
    try:
        y = np.ones(4, np.float32)
        comm.all_reduce(y, op="sum")
        after = {"sum": float(y[0])}
    except shoal.ShoalError as e:
        after = {"type": type(e).__name__, "msg": str(e)}
    return {"broadcast": broadcast, "after": after, "took": time.monotonic() - start}


def loop(spec: dict) -> dict:
    """The loops users write, over a shared state: ``shape`` "readme" (sync, all_reduce, then
    peers_pending / update_topology; update_topology after PeerLostError), "retry" (the same,
    but a failure is only retried) or "pccl" (peers_pending / update_topology at the top, then
    sync and all_reduce; any error goes back to the top, as PCCL's loop does). Runs until revision
    ``steps``; records every step's revision, world and state hash, every error, and the longest
    call."""
    comm = communicator(spec, timeout=30, heartbeat_timeout=spec.get("heartbeat_timeout"))
    comm.connect(timeout=30)
    print(json.dumps({"ready": comm.peer_id}), flush=True)
    w = np.zeros(1024, np.float32)
    state, shape = shoal.SharedState({"w": w}), spec["shape"]
    step, steps, errors, longest = 0, [], [], [0.0, ""]

    def timed(name: str, call):
        started = time.time()
        try:
            return call()
        finally:
            if time.time() - started > longest[0]:
                longest[:] = [time.time() - started, name]

    while step < spec["steps"]:
        try:
            if shape == "pccl" and timed("peers_pending", comm.peers_pending):
                timed("update_topology", comm.update_topology)
            state.revision = step
            timed("sync_shared_state", lambda: comm.sync_shared_state(state))
            step = state.revision
            g = np.ones(1024, np.float32)
            info = timed("all_reduce", lambda: comm.all_reduce(g, op="avg"))
            w += g  # the average of ones is exactly one: the state is a function of the revision
            steps.append({"revision": step, "world": info.world_size, "state": shoal.hash_tensor(w)})
            step += 1
            if shape != "pccl" and timed("peers_pending", comm.peers_pending):
                timed("update_topology", comm.update_topology)
            time.sleep(spec.get("pause", 0.02))
        except shoal.PeerLostError as e:
            errors.append(str(e))
            if shape == "readme":
                timed("update_topology", comm.update_topology)
    comm.close()
    return {"steps": steps, "errors": errors, "longest": longest}


def mismatched_calls(spec: dict) -> dict:
    """Peer 0 makes the call ``first``, the others the call ``others``: calls that can never
    complete together. ``order`` says who calls first: "first_last" (peer 0 0.3 s after the
    others), "first_first" (peer 0 0.3 s before them) or "staggered" (peer 0, then peer 1 0.15 s
    later, then peer 2 at 0.3 s). Every one must end with UsageError naming the calls, quickly,
    while every peer stays alive and calls nothing else until all have ended (a file each in
    ``out``'s folder); then all run one matching all-reduce (retried, as a failed call may be)."""
    comm = communicator(spec, timeout=spec.get("call_timeout", 60))
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    comm.all_reduce(np.ones(1, np.float32))  # nobody is a newcomer at the top of its loop
    state = shoal.SharedState({"w": np.zeros(8, np.float32)}, revision=0)
    world, rank = comm.group_world_size, comm.rank

    def p2p() -> None:
        out, inp = np.full(16, rank, np.float32), np.empty(16, np.float32)
        sent = comm.isend(out, peer=(rank + 1) % world, tag=3)
        comm.recv(inp, peer=(rank - 1) % world, tag=3)
        sent.wait()

    calls = {
        "peers_pending": comm.peers_pending,
        "update_topology": comm.update_topology,
        "optimize_topology": comm.optimize_topology,
        "sync_shared_state": lambda: comm.sync_shared_state(state),
        "all_reduce": lambda: comm.all_reduce(np.ones(1000, np.float32)),
        "barrier": comm.barrier,
        "p2p": p2p,
    }
    call = spec["first"] if spec["index"] == 0 else spec["others"]
    delay = {"first_last": [0.3, 0, 0], "first_first": [0, 0.3, 0.3],
             "staggered": [0, 0.15, 0.3]}[spec.get("order", "first_last")][spec["index"]]
    time.sleep(delay)
    started = time.time()
    try:
        calls[call]()
        error = None
    except shoal.ShoalError as e:
        error = {"type": type(e).__name__, "msg": str(e)}
    took = time.time() - started
    folder = Path(spec["out"]).parent
    (folder / f"ended{spec['index']}").touch()
    deadline = time.time() + 30
    while len(list(folder.glob("ended*"))) < spec["peers"] and time.time() < deadline:
        time.sleep(0.01)
    retried = []
    for _ in range(5):
        y = np.ones(10, np.float32)
        try:
            comm.all_reduce(y, op="sum")
            break
        except shoal.ShoalError as e:
            retried.append(f"{type(e).__name__}: {e}")
    return {"call": call, "error": error, "took": took, "after": float(y[0]), "retried": retried}


def links(spec: dict) -> dict:
    """The links ring all-reduces and then one-shot ones open, as ``links()`` shows them."""
    os.environ["SHOAL_ALGO"] = "ring"  # calls that name no algorithm, as while joining
    comm = communicator(spec, timeout=30)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    big = np.ones(1 << 18, np.float32)
    ring = comm.all_reduce(big, op="sum", tag=1)
    assert big[0] == spec["peers"], big[0]
    after_ring = comm.links()
    seen = []
    for i in range(2):
        y = np.full(64, comm.rank + 1.0, np.float32)
        info = comm.all_reduce(y, op="sum", tag=2 + i, algorithm="oneshot")
        assert y[0] == sum(range(1, spec["peers"] + 1)), y[0]
        seen.append((info.algorithm, comm.links()))
    # Nobody leaves (closing its streams) before everyone looked.
    comm.all_reduce(np.ones(1, np.float32), op="sum", tag=9)
    return {"rank": comm.rank, "index": spec["index"], "ring": ring.algorithm, "after_ring": after_ring,
            "after_oneshot": seen}


def shapes(spec: dict) -> dict:
    """A zero-element all-reduce across peers, then an ordinary one, then arrays of other
    shapes (taken natively as they are), and arrays refused by name without traffic."""
    comm = communicator(spec, timeout=30)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    comm.all_reduce(np.zeros(0, np.float32), op="sum")
    comm.all_reduce(np.zeros(0, np.float64), op="avg", algorithm="ring")
    comm.all_reduce(np.zeros(0, np.float64), op="avg", algorithm="oneshot")
    y = np.ones(10, np.float32)
    info = comm.all_reduce(y, op="sum")
    grid = np.arange(15, dtype=np.int32).reshape(3, 5) * (spec["index"] + 1)
    scalar = np.array(spec["index"] + 0.5)
    comm.all_reduce(grid, op="sum")
    comm.all_reduce(scalar, op="max")
    block = np.full((2, 3), spec["index"] + 1, np.float64)
    comm.all_reduce_async(block, op="prod", tag=3).wait()
    refused = []
    for bad in (np.ones((4, 3), np.float32, order="F"), np.ones(4, ">f4")):
        try:
            comm.all_reduce(bad, op="sum")
        except (TypeError, ValueError) as e:
            refused.append(type(e).__name__)
    return {"world": info.world_size, "after": float(y[0]), "grid": grid.tolist(), "scalar": float(scalar),
            "block": block.tolist(), "refused": refused}


def may_read_other_processes() -> bool:
    """Whether ``process_vm_readv`` may read another process of our user: Yama's
    ``ptrace_scope`` 0, or 1 and 2 with root's ``CAP_SYS_PTRACE``, or no Yama at all."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read())
    except OSError:
        return True
    return scope == 0 or (scope in (1, 2) and os.geteuid() == 0)


def p2p(spec: dict) -> dict:
    """Tagged sends and receives around the ring in every dtype, posted in opposite orders on
    the two ends, beside collectives; then mismatched and misused calls."""
    comm = communicator(spec, connections=3, chunk_bytes=4096, timeout=30)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    rank, n = comm.rank, spec["peers"]
    succ, pred = (rank + 1) % n, (rank - 1) % n
    sends = [comm.isend(inputs(dtype, "sum", rank), peer=succ, tag=i) for i, dtype in enumerate(DTYPES)]
    got = {dtype: np.zeros(LEN, dtype) for dtype in DTYPES}
    # Receives in reverse tag order, the first blocking while every send waits to be matched.
    for i, dtype in reversed(list(enumerate(DTYPES))):
        info = comm.recv(got[dtype], peer=pred, tag=i)
        assert info.algorithm == "direct" and info.rx_bytes == got[dtype].nbytes, info
    for w, dtype in zip(sends, DTYPES):
        assert w.wait(timeout=30).tx_bytes == got[dtype].nbytes
    ok = all(got[d].tobytes() == inputs(d, "sum", pred).tobytes() for d in DTYPES)
    # A large transfer both ways at once, with an all-reduce in flight beside it.
    big = np.arange(3_000_000, dtype=np.float32) + rank
    into = np.zeros_like(big)
    r = np.full(1000, rank + 1.0)
    works = [comm.all_reduce_async(r, op="sum", tag=7), comm.irecv(into, peer=pred, tag=100),
             comm.isend(big, peer=succ, tag=100)]
    infos = [w.wait(timeout=60) for w in works]
    ok = ok and (into == np.arange(3_000_000, dtype=np.float32) + pred).all() and r[0] == n * (n + 1) / 2
    # On one host the receiver read it straight out of the sender's memory, where the kernel lets
    # it; across hosts (``apart``: the lab's) it came over the network.
    expected = "single_copy" if may_read_other_processes() and not spec.get("apart") else "direct"
    assert [i.algorithm for i in infos[1:]] == [expected] * 2, infos
    assert infos[1].rx_bytes == infos[2].tx_bytes == big.nbytes, infos
    # Mismatches fail both ends; the link carries on.
    errors = {}
    for case, tag, wrong in [("size", 200, np.zeros(12, np.float32)), ("dtype", 201, np.zeros(10, np.int32))]:
        try:
            if rank == 0:
                comm.send(np.ones(10, np.float32), peer=1, tag=tag)
            elif rank == 1:
                comm.recv(wrong, peer=0, tag=tag)
        except shoal.CollectiveMismatchError as e:
            errors[case] = str(e)
    # Several sends with one tag in flight meet the receives with it in the order both sides made them.
    ws = [comm.isend(np.full(3, k, np.int64), peer=succ, tag=300) for k in range(3)]
    try:
        comm.send(np.ones(3, np.int64), peer=rank, tag=301)
    except shoal.UsageError as e:
        errors["self"] = str(e)
    back = [np.zeros(3, np.int64) for _ in range(3)]
    for b in back:
        comm.recv(b, peer=pred, tag=300)
    for w in ws:
        w.wait(timeout=30)
    # Receives from any member: every other rank sends rank 0 two arrays with one tag; rank 0
    # takes them as they come, each rank's in the order it sent them, and learns whose each is.
    senders: dict[int, list[int]] = {}
    if rank == 0:
        for k in range(2 * (n - 1)):
            into = np.zeros(4, np.int64)
            work = comm.irecv(into, peer=None, tag=400) if k % 2 else None
            info = work.wait(timeout=30) if work else comm.recv(into, peer=None, tag=400)
            assert info.algorithm == "direct" and info.rx_bytes == into.nbytes, info
            senders.setdefault(info.peer, []).append(int(into[0]))
            assert (into == into[0]).all() and into[0] // 10 == info.peer, (into, info)
    else:
        for k in range(2):
            comm.send(np.full(4, 10 * rank + k, np.int64), peer=0, tag=400)
    # A receive from any member while every other member waits in a barrier for us: it ends with
    # a usage error naming both calls, well before its bound, and the barrier then completes.
    if rank == 0:
        began = time.monotonic()
        try:
            comm.recv(np.zeros(1), peer=None, tag=401)
        except shoal.UsageError as e:
            errors["any"] = (str(e), time.monotonic() - began)
    comm.barrier(tag=10)
    # Nobody leaves (closing its streams) before everyone is done.
    comm.barrier(tag=9)
    return {"rank": rank, "ok": bool(ok), "errors": errors, "back": [b.tolist() for b in back],
            "senders": {str(k): v for k, v in senders.items()}}


def p2p_ring(spec: dict) -> dict:
    """Sends to the next rank and receives from the previous one, step after step, until a
    transfer fails (a peer is killed or frozen); then all-reduces until the smaller world forms,
    and runs ``steps_after`` more steps of transfers in it."""
    comm = communicator(spec, timeout=60, heartbeat_timeout=spec.get("heartbeat_timeout"))
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    print(json.dumps({"ready": comm.peer_id}), flush=True)

    def step(tag: int) -> list:
        rank, n = comm.rank, comm.group_world_size
        out = np.full(1 << 16, float(rank), np.float32)
        into = np.zeros_like(out)
        works = [comm.isend(out, peer=(rank + 1) % n, tag=tag), comm.irecv(into, peer=(rank - 1) % n, tag=tag)]
        errors = []
        for w in works:
            try:
                w.wait()
            except shoal.PeerLostError as e:
                errors.append({"at": time.time(), "error": str(e)})
        if not errors:
            assert (into == float((rank - 1) % n)).all(), into[:3]
        return errors

    errors, tag, deadline = [], 0, time.time() + 60
    while not errors and time.time() < deadline:
        errors = step(tag)
        tag += 1
    while time.time() < deadline:
        try:
            if comm.all_reduce(np.ones(1, np.float32), op="sum").world_size < spec["peers"]:
                break
        except shoal.PeerLostError:
            pass
    for k in range(spec["steps_after"]):
        assert not step(1000 + k), "a transfer failed in the smaller world"
    comm.barrier(tag=5)
    return {"errors": errors, "world": comm.group_world_size, "steps": tag}


def optimize(spec: dict) -> dict:
    """Joins, re-orders the ring by measured links (``times`` times, once by default), then
    all-reduces: reports the ring (peer ids by rank), the measured matrix and the sum."""
    comm = communicator(spec, timeout=60)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    before = comm.rank
    for _ in range(spec.get("times", 1)):
        comm.optimize_topology()
    ranks = np.zeros(comm.group_world_size, np.float32)
    comm.all_gather(ranks, np.array([float(comm.peer_id)], np.float32))
    x = np.ones(2 << 20, np.float32)  # 8 MiB: above two-shot's sizes
    info = comm.all_reduce(x, op="sum")
    assert (x == info.world_size).all()
    return {"index": spec["index"], "before": before, "rank": comm.rank, "peer_id": comm.peer_id,
            "ring": [int(r) for r in ranks], "matrix": comm.bandwidth_matrix(),
            "streams_out": {link["rank"]: link["streams_out"] for link in comm.links()},
            "sum": float(x[0]), "world": info.world_size, "algorithm": info.algorithm}


def drift(spec: dict) -> dict:
    """Joins, re-orders the ring by measured links and writes it to ``ring`` (the test then makes
    one of its links lossy); all-reduces through the ring until ``peers_pending`` says the master
    re-planned it, and takes the new ring with ``update_topology``. Reports both rings (each
    rank's launch index) and the sum in the new one."""
    comm = communicator(spec, timeout=120, heartbeat_timeout=spec["heartbeat"])
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    comm.optimize_topology()

    def ring() -> list[int]:
        indices = np.zeros(comm.group_world_size, np.float32)
        comm.all_gather(indices, np.array([float(spec["index"])], np.float32))
        return [int(i) for i in indices]

    before = ring()
    if comm.rank == 0:
        with open(spec["ring"] + ".tmp", "w") as f:
            json.dump(before, f)
        os.rename(spec["ring"] + ".tmp", spec["ring"])
    x = np.ones(spec["elements"], np.float32)
    deadline, steps = time.monotonic() + spec["within"], 0
    while not comm.peers_pending():
        if time.monotonic() > deadline:
            return {"index": spec["index"], "before": before, "after": None, "steps": steps, "links": comm.links()}
        comm.all_reduce(x, algorithm="ring")
        steps += 1
    comm.update_topology()
    after = ring()
    x = np.ones(spec["elements"], np.float32)
    info = comm.all_reduce(x, op="sum", algorithm="ring")
    return {"index": spec["index"], "before": before, "after": after, "steps": steps, "sum": float(x[0]),
            "world": info.world_size}


def watched(spec: dict) -> dict:
    """Joins, measures the links, syncs a shared state and all-reduces ``rounds`` times (the peer
    of index ``slow`` computes ``slow_s`` longer before each), then stays in the run (the test
    reads the master's status) until the file ``stop`` appears; reports ``stats()`` and every
    all-reduce's lateness figures."""
    comm = communicator(spec, timeout=60, heartbeat_timeout=spec["heartbeat"])
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    comm.optimize_topology()
    comm.sync_shared_state(shoal.SharedState({"w": np.arange(16, dtype=np.float32)}, revision=7))
    x = np.ones(64 << 10, np.float32)
    late = []
    for _ in range(spec["rounds"]):
        if spec["index"] == spec["slow"]:
            time.sleep(spec["slow_s"])
        info = comm.all_reduce(x, op="avg")
        late.append({"op": [info.topology, info.sequence], "lateness": info.lateness, "last": info.last,
                     "rank": info.rank})
    # Written whole, then named: the test reads it as soon as the name exists.
    done = Path(spec["out"] + ".done")
    partial = done.with_suffix(".partial")
    partial.write_text(json.dumps({"peer": comm.peer_id,
                                   "all_reduce": comm.stats()["operations"]["all_reduce"]["succeeded"]}))
    partial.rename(done)
    while not os.path.exists(spec["stop"]):
        time.sleep(0.05)
    result = {"rank": comm.rank, "stats": comm.stats(), "late": late}
    comm.close()
    return result


def barrier_lost(spec: dict) -> dict:
    """Every peer but the victim waits in a barrier the victim never enters (the test kills or
    freezes it); then all-reduces until it succeeds in the smaller world."""
    comm = communicator(spec, timeout=60, heartbeat_timeout=spec.get("heartbeat_timeout"))
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    print(json.dumps({"ready": comm.peer_id}), flush=True)
    if spec["index"] == spec["victim"]:
        time.sleep(120)
        raise AssertionError("the victim was not killed")
    try:
        comm.barrier(tag=3)
        outcome = {"barrier": "ok"}
    except shoal.PeerLostError as e:
        outcome = {"barrier": str(e), "at": time.time()}
    for _ in range(5):
        try:
            info = comm.all_reduce(np.ones(4, np.float32), op="sum")
            return {**outcome, "world": info.world_size}
        except shoal.PeerLostError:
            pass
    return {**outcome, "world": None}


QUANTIZATIONS = ["fp16", "bf16", "int8", "int4"]


def normal(dtype: str, rank: int, seed: int, n: int = 8 * LEN) -> np.ndarray:
    """Rank ``rank``'s normally distributed input number ``seed``."""
    return np.random.default_rng(1000 * rank + seed).standard_normal(n).astype(dtype)


def quantized(spec: dict) -> dict:
    """Quantized all-reduces in every mode, float dtype and algorithm, then the async, many,
    gather and scatter variants; results saved for the test to compare across peers. Reports the
    bytes sent (and those of the same call unquantized), each result's error against the exact
    average of every peer's input, the refusals, and error feedback's accumulated error."""
    comm = communicator(spec, connections=2, chunk_bytes=16384)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    rank, n = comm.rank, spec["peers"]
    results, sent, errors = {}, {}, {}

    def record(key: str, x: np.ndarray, exact: np.ndarray, info: "shoal.ReduceInfo") -> None:
        results[key], sent[key] = x, info.tx_bytes
        err = x.astype(np.float64) - exact
        errors[key] = {"max": float(np.abs(err).max()), "mean": float(err.mean()),
                       "mean_abs": float(np.abs(err).mean())}

    for seed, (q, dtype, algorithm) in enumerate(
            (q, d, a) for q in QUANTIZATIONS for d in ["float16", "float32", "float64"]
            for a in ["ring", "oneshot", "twoshot", "hierarchical", "twolevel"]):
        if (q, dtype) == ("bf16", "float16"):
            continue
        exact = sum(normal(dtype, r, seed).astype(np.float64) for r in range(n)) / n
        plain = normal(dtype, rank, seed)
        sent[f"none/{dtype}/{algorithm}"] = comm.all_reduce(plain, op="avg", algorithm=algorithm).tx_bytes
        x = normal(dtype, rank, seed)
        record(f"{q}/{dtype}/{algorithm}", x, exact, comm.all_reduce(x, op="avg", quantization=q, algorithm=algorithm))
    # The async, many, gather and scatter variants, int8 with blocks of 64.
    exact = sum(normal("float32", r, 1).astype(np.float64) for r in range(n))
    x = normal("float32", rank, 1)
    record("async", x, exact, comm.all_reduce_async(x, op="sum", tag=3, quantization="int8",
                                                    quantization_block=64).wait())
    many = [normal("float32", rank, 1), normal("float64", rank, 1)]
    infos = comm.all_reduce_many(many, op="sum", quantization="int8", quantization_block=64)
    record("many0", many[0], exact, infos[0])
    record("many1", many[1], sum(normal("float64", r, 1) for r in range(n)), infos[1])
    out = np.zeros(n * 8 * LEN, np.float32)
    record("gather", out, np.concatenate([normal("float32", r, 2) for r in range(n)]),
           comm.all_gather(out, normal("float32", rank, 2), quantization="int8"))
    block = np.zeros(8 * LEN, np.float32)
    scatter_exact = sum(normal("float32", r, 3, n * 8 * LEN).astype(np.float64) for r in range(n))
    record("scatter", block, scatter_exact[rank * 8 * LEN:(rank + 1) * 8 * LEN],
           comm.reduce_scatter(block, normal("float32", rank, 3, n * 8 * LEN), quantization="int8"))
    refused = []
    for tensor, op, q in [(np.ones(4, np.int32), "sum", "int8"), (np.ones(4, np.float32), "max", "int8"),
                          (np.ones(4, np.float32), "sum", "int3"), (np.ones(4, np.float32), "prod", "fp16")]:
        try:
            comm.all_reduce(tensor, op=op, quantization=q)
        except ValueError as e:
            refused.append(str(e))
    # Error feedback: the same outer gradient averaged for 30 steps; the sum of the results
    # drifts from 30 times the exact average without it, and stays within a step with it.
    g = normal("float32", rank, 4)
    g_exact = sum(normal("float32", r, 4).astype(np.float64) for r in range(n)) / n
    ef, drift = shoal.ErrorFeedback("int4"), {}
    for name in ("plain", "feedback"):
        total = np.zeros_like(g_exact)
        for _ in range(30):
            x = g.copy()
            if name == "plain":
                comm.all_reduce(x, op="avg", quantization="int4")
            else:
                ef.all_reduce(comm, x, key="g")
            total += x
        drift[name] = float(np.abs(total - 30 * g_exact).mean())
    np.savez(spec["out"] + ".npz", **results)
    return {"rank": rank, "sent": sent, "errors": errors, "refused": refused, "drift": drift}


def catchup(spec: dict) -> dict:
    """A training loop over ``spec["mib"]`` MiB of shared state: ``w`` changes at step 2 only, the
    step count every step. Accepted peers (``role: "member"``) loop until they took
    ``steps_after`` steps in a group of ``whole`` since they admitted the newcomer, timing each
    step; the newcomer
    (``role: "newcomer"``) catches up while they go on, printing its progress, then takes
    ``steps_after`` steps. Every peer reports the hashes of its state at each revision once the
    group is whole. A lost peer's step is retried."""
    comm = communicator(spec, timeout=120, heartbeat_timeout=spec.get("heartbeat_timeout"))
    w = np.zeros(spec["mib"] << 18, np.float32)
    step = np.zeros(1, np.uint64)
    state = shoal.SharedState({"w": w, "step": step})
    whole, times, hashes, received = spec["whole"], [], {}, []
    if spec["role"] == "newcomer":
        w[:] = -1
        started = time.time()

        def progress(p: shoal.CatchUpProgress) -> None:
            print(json.dumps({"progress": p.done / p.total}), flush=True)

        info = comm.connect(timeout=120, catch_up=state, progress=progress)
        assert info is not None
        caught = {"revision": info.revision, "bytes": info.fetched_bytes, "donors": info.donors,
                  "skipped": info.skipped, "started": started, "ended": time.time()}
        first = True
    else:
        comm.connect(timeout=60, min_world_size=spec["peers"])
        w[:] = 1.0
        print(json.dumps({"ready": comm.peer_id}), flush=True)
        caught, first = None, False
    steps_after, admitted = 0, caught is not None
    while steps_after < spec["steps_after"]:
        t0 = time.time()
        try:
            if not first and comm.peers_pending():
                comm.update_topology()
                admitted = True
            first = False
            state.revision = int(step[0])
            synced = comm.sync_shared_state(state)
            grad = np.ones(1 << 18, np.float32)
            comm.all_reduce(grad, op="sum")
        except shoal.PeerLostError:
            continue  # the ring re-forms by itself: the step again
        if admitted and comm.group_world_size == whole:
            steps_after += 1
            hashes[str(synced.revision)] = state.hashes()
            received.append(synced.received_bytes)
        step[0] += 1
        if step[0] == 2:
            w += 1.0
        times.append([t0, time.time() - t0, comm.group_world_size])
        if caught is None:
            print(json.dumps({"step": int(step[0])}), flush=True)
        time.sleep(spec.get("pause", 0.0))
    return {"times": times, "hashes": hashes, "received": received, "caught": caught, "peer": comm.peer_id}


def deadline(spec: dict) -> dict:
    """All-reduces with a deadline: round 1 with peer ``late`` 1 s late (left out), a barrier, round
    2 on time, round 3 with it late again but ``min_participants`` of the whole group (waited for),
    round 4 async and late (left out). Each round's tensor holds the peer's index + 1 and the
    round; reports every round's values, info and error."""
    comm = communicator(spec, timeout=60)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    me, late = spec["index"], spec["late"]
    rounds = []
    for r, (delay, least, asynchronous) in enumerate([(0, None, False), (1.0, None, False), (0, None, False),
                                                      (0.6, spec["peers"], False), (1.0, None, True)]):
        if r == 2:
            comm.barrier(tag=99)
        x = np.array([me + 1, r], np.float64)
        if me == late:
            time.sleep(delay)
        t0 = time.monotonic()
        outcome: dict = {"round": r}
        try:
            if asynchronous:
                info = comm.all_reduce_async(x, op="avg", tag=r, deadline=0.3, min_participants=least).wait()
            else:
                info = comm.all_reduce(x, op="avg", tag=r, deadline=0.3, min_participants=least)
            outcome.update(included=info.included, world=info.world_size, topology=info.topology,
                           sequence=info.sequence, rank=info.rank)
        except shoal.ExcludedError as e:
            outcome.update(excluded=str(e), included=e.included, topology=e.topology, sequence=e.sequence)
        outcome.update(values=x.tolist(), took=time.monotonic() - t0)
        rounds.append(outcome)
    final = comm.all_reduce(np.ones(1, np.float32), op="sum", tag=7)
    comm.barrier(tag=98)
    result = {"rank": comm.rank, "rounds": rounds, "world": final.world_size, "topology": final.topology}
    comm.close()
    return result


def deadline_verbs(spec: dict) -> dict:
    """The other collectives with a deadline, the peer of index ``late`` 1 s late to each but the
    broadcast from its own rank (0.6 s late there, and waited for): all-gather, reduce-scatter,
    broadcast from it, broadcast from the lowest other rank, then the all-gather and
    reduce-scatter again async. Each peer's all-gather input
    is ``rank + 1``, its reduce-scatter input block ``b`` ``rank + 1 + 10 b``, a broadcast's tensor
    ``rank + 1``; outputs start at -1. Reports each call's outcome and output."""
    comm = communicator(spec, timeout=60)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    me, rank, world = spec["index"], comm.rank, comm.group_world_size
    late_rank = np.array([rank if me == spec["late"] else -1], np.int64)
    # With a deadline, on time: no member is a newcomer the master would wait for after it.
    comm.all_reduce(late_rank, op="max", tag=9, deadline=5.0)
    on_time_root = 1 if late_rank[0] == 0 else 0
    calls = []
    plan = [("all_gather", 1.0, False), ("reduce_scatter", 1.0, False), ("broadcast_late", 0.6, False),
            ("broadcast", 1.0, False), ("all_gather", 1.0, True), ("reduce_scatter", 1.0, True)]
    for tag, (verb, lag, asynchronous) in enumerate(plan):
        comm.barrier(tag=99)
        if me == spec["late"]:
            time.sleep(lag)
        cut = {"deadline": 0.3}
        if verb == "all_gather":
            out, inp = np.full(2 * world, -1.0), np.full(2, rank + 1.0)
            run = comm.all_gather_async if asynchronous else comm.all_gather
            call = lambda: run(out, inp, tag=tag, **cut)  # noqa: E731
        elif verb == "reduce_scatter":
            out = np.full(2, -1.0)
            inp = np.repeat(rank + 1.0 + 10.0 * np.arange(world), 2)
            run = comm.reduce_scatter_async if asynchronous else comm.reduce_scatter
            call = lambda: run(out, inp, op="sum", tag=tag, **cut)  # noqa: E731
        else:
            out = np.full(3, rank + 1.0)
            root = int(late_rank[0]) if verb == "broadcast_late" else on_time_root
            call = lambda: comm.broadcast(out, root=root, tag=tag, **cut)  # noqa: E731
        t0 = time.monotonic()
        try:
            info = call()
            if asynchronous:
                info = info.wait()
            outcome: dict = {"included": info.included, "sequence": info.sequence, "world": info.world_size}
        except shoal.ExcludedError as e:
            outcome = {"included": e.included, "sequence": e.sequence, "excluded": True}
        calls.append({**outcome, "verb": verb, "out": out.tolist(), "took": time.monotonic() - t0})
    comm.barrier(tag=98)
    result = {"rank": rank, "index": me, "world": world, "late_rank": int(late_rank[0]), "calls": calls}
    comm.close()
    return result


def skip_ahead(spec: dict) -> dict:
    """All-reduces with a deadline, ``rounds`` of them: the peer of index ``late`` sleeps ``lag`` s
    before its second, so the others run several without it; then it calls on until it is in one,
    each left-out call skipping one of those it missed (``ExcludedError.ahead``). Reports every
    call's outcome."""
    comm = communicator(spec, timeout=60)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    me = spec["index"]
    calls = []
    for r in range(spec["rounds"]):
        if me == spec["late"] and r == 1:
            time.sleep(spec["lag"])
        elif me != spec["late"]:
            time.sleep(0.02)
        x = np.array([me + 1, r], np.float64)
        t0 = time.monotonic()
        try:
            info = comm.all_reduce(x, op="avg", tag=3, deadline=spec["deadline"])
            outcome: dict = {"included": info.included, "sequence": info.sequence, "values": x.tolist()}
        except shoal.ExcludedError as e:
            outcome = {"included": e.included, "sequence": e.sequence, "ahead": e.ahead, "values": x.tolist()}
        calls.append({**outcome, "took": time.monotonic() - t0})
    comm.barrier(tag=98)
    result = {"rank": comm.rank, "index": me, "calls": calls}
    comm.close()
    return result


def diloco_late(spec: dict) -> dict:
    """DiLoCo (or AsyncDiLoCo) with a deadline on a model whose every inner step adds ``index + 1``
    to each parameter (plain outer SGD, step 1: the anchor moves by the mean pseudo-gradient of the
    peers an outer step ran among). Every peer computes ``pause`` s an outer step; the peer of
    index ``slow`` ``lag`` s more, at outer step 2 (at every one with ``every``). The model has
    ``size`` parameters (4). Records each outer step's anchor and included ranks."""
    import torch

    from shoal.torch import AsyncDiLoCo, DiLoCo

    comm = communicator(spec, timeout=30)
    comm.connect(timeout=30)
    join_all(comm, spec["peers"])
    param = torch.nn.Parameter(torch.zeros(spec.get("size", 4), dtype=torch.float64))
    kind = AsyncDiLoCo if spec["async"] else DiLoCo
    recipe = kind(comm, [param], inner_steps=5, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                  deadline=spec["deadline"])
    recipe.join()
    def anchor() -> list:  # every element moves alike: the first, and the hash of all
        return [float(recipe.anchor[0]), shoal.hash_tensor(recipe.anchor)]

    records = []
    while recipe.outer_steps < spec["outer"]:
        with torch.no_grad():
            param.add_(spec["index"] + 1.0)
        if recipe.inner == recipe.inner_steps - 1:
            time.sleep(spec["pause"])
            if spec["index"] == spec["slow"] and (spec.get("every") or recipe.outer_steps == 2):
                time.sleep(spec["lag"])
        if recipe.step():
            records.append({"outer": recipe.outer_steps, "anchor": anchor(), "included": recipe.last_included})
    recipe.finish()
    records.append({"outer": "final", "anchor": anchor(), "included": recipe.last_included})
    comm.barrier(tag=5)
    result = {"rank": comm.rank, "index": spec["index"], "records": records}
    comm.close()
    return result


if __name__ == "__main__":
    scenario, spec = sys.argv[1], json.loads(sys.argv[2])
    scenarios = {"overlap": overlap, "many_survive": many_survive,
                 "matrix": matrix, "torch": torch_tensors, "join_late": join_late, "survive": survive,
                 "agree": agree, "min_world": min_world, "pipeline_dp": pipeline_dp, "derived": derived, "busy": busy,
                 "master_loss": master_loss,
                 "admission_misuse": admission_misuse, "die_at": die_at, "sgd": sgd,
                 "sync_case": sync_case, "repairs": repairs, "mismatch": mismatch, "shapes": shapes, "loop": loop,
                 "mismatched_calls": mismatched_calls, "late_misuse": late_misuse, "links": links, "verbs": verbs,
                 "p2p": p2p, "p2p_ring": p2p_ring,
                 "barrier_lost": barrier_lost, "optimize": optimize, "drift": drift, "quantized": quantized,
                 "watched": watched,
                 "restart_loop": restart_loop, "diloco": diloco,
                 "ddp": ddp, "catchup": catchup, "deadline": deadline,
                 "diloco_late": diloco_late, "skip_ahead": skip_ahead,
                 "deadline_verbs": deadline_verbs}
    result = scenarios[scenario](spec)
    print(json.dumps(result), flush=True)
