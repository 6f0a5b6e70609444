"""Pipeline × data parallelism: replicas of a two-stage pipeline, each process in two groups.

The digits MLP of ``shoal demo --train`` (torch, scikit-learn) is cut in two stages: stage 0 holds
``Linear(64, 64), ReLU``, stage 1 ``Linear(64, 10)`` and the loss. Process (replica r, stage s)
opens two communicators, connected one after the other:

- ``pipe``, group ``200 + r``: the replica's pipeline. Each step runs the 1F1B schedule over
  micro-batches with tagged ``isend``/``recv`` (activations forward, their gradients back).
- ``dp``, group ``100 + s``: the stage's replicas. Each step starts with ``sync_shared_state`` of
  the stage's parameters, averages their gradients with ``all_reduce``, and ends with the
  admission check (the README's loop), so the replicas' parameters stay bit-identical. A new
  replica is admitted whole: each replica takes the minimum of its stages' ``peers_pending()``
  over its pipeline, so every stage's group admits its newcomer at the same step (one admitted
  alone would wait, pipelining, for a partner its group's survivors cannot admit before their
  step ends, which waits for it).

``--demo`` runs it all on this machine: a master, ``--replicas`` pipelines, then replica
``replicas - 1``'s last stage is SIGKILLed in the middle of a step. Its pipeline partner sees
``PeerLostError`` and leaves cleanly; the other replicas carry on with a smaller data-parallel
world. Halfway through, a new replica starts: each of its processes catches up its stage's state
from the survivors (``connect(catch_up=...)``) and the data-parallel world grows back. The demo
checks every one of those facts and that every stage ends bit-identical on all its replicas::

    python examples/hybrid_pp_dp.py --demo --replicas 2 --steps 30

One process by hand: ``python examples/hybrid_pp_dp.py --master HOST:PORT --replica R --stage S``
(``--join`` for a replica that joins a run under way).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, TypeVar

import numpy as np
import shoal

STAGES, MICRO_BATCHES, MICRO_BATCH, LR = 2, 4, 16, 0.2
T = TypeVar("T")


def retried(call: Callable[[], T]) -> T:
    """A collective or sync of the stage's replicas: a lost member aborts it (nothing changed, the
    group re-forms by itself) and it is made again."""
    while True:
        try:
            return call()
        except shoal.PeerLostError:
            continue


def pipeline_step(pipe: shoal.Communicator, other: int, stage: int, layer, x, y, step: int) -> float:
    """One 1F1B step of this stage over the micro-batches of ``x`` (stage 0) or ``y`` (stage 1):
    accumulates the layer's gradients; returns the loss on the last stage."""
    import torch

    outputs: dict = {}
    sends: list[shoal.Work] = []
    loss = 0.0

    def tag(m: int, backward: bool) -> int:
        return step * 1000 + 2 * m + int(backward)

    def forward(m: int) -> None:
        nonlocal loss
        if stage == 0:
            out = layer(x[m])
            outputs[m] = out
            sends.append(pipe.isend(out.detach().contiguous(), peer=other, tag=tag(m, False)))
        else:
            act = torch.empty(MICRO_BATCH, 64)
            pipe.recv(act, peer=other, tag=tag(m, False))
            act.requires_grad_(True)
            part = torch.nn.functional.cross_entropy(layer(act), y[m]) / MICRO_BATCHES
            part.backward()
            loss += part.item()
            sends.append(pipe.isend(act.grad.contiguous(), peer=other, tag=tag(m, True)))

    def backward(m: int) -> None:
        if stage == 0:
            grad = torch.empty(MICRO_BATCH, 64)
            pipe.recv(grad, peer=other, tag=tag(m, True))
            outputs.pop(m).backward(grad)

    warmup = STAGES - stage - 1  # 1F1B: the first stage runs ahead by one forward
    for m in range(warmup):
        forward(m)
    for m in range(MICRO_BATCHES - warmup):
        forward(warmup + m)
        backward(m)
    for m in range(MICRO_BATCHES - warmup, MICRO_BATCHES):
        backward(m)
    for work in sends:
        work.wait()
    return loss


def process(master: str, replica: int, stage: int, replicas: int, steps: int, join: bool, die_at: int,
            pause: float) -> None:
    import torch
    from shoal.train import digits, model

    def say(**event: object) -> None:
        print(json.dumps({"replica": replica, "stage": stage, **event}), flush=True)

    images, labels, _, _ = digits()
    net = model()
    layer = net[0:2] if stage == 0 else net[2:3]
    params = list(layer.parameters())
    state = shoal.SharedState({f"stage{stage}.{i}": p.data for i, p in enumerate(params)})
    if join and not sys.stdin.isatty():
        sys.stdin.readline()  # started ahead by --demo (imports take seconds): wait for the word
    pipe = shoal.Communicator(master, peer_group=200 + replica, timeout=120)
    dp = shoal.Communicator(master, peer_group=100 + stage, timeout=120)
    pipe.connect(timeout=120, min_world_size=STAGES)
    # The pipeline partner's rank: ranks are join order, stages are the application's.
    stages = np.zeros(STAGES, np.int64)
    pipe.all_gather(stages, np.array([stage], np.int64))
    other = int(np.flatnonzero(stages != stage)[0])
    if join:
        caught = dp.connect(timeout=120, catch_up=state)
        assert caught is not None
        say(event="joined", revision=caught.revision, fetched=caught.fetched_bytes)
    else:
        dp.connect(timeout=120, min_world_size=replicas)
    while True:
        retried(lambda: dp.sync_shared_state(state))
        step = state.revision
        if step >= steps:
            break
        # Each replica draws its own samples, the same on both of its stages.
        rows = torch.randperm(len(images), generator=torch.Generator().manual_seed(step * 1009 + replica))
        rows = rows[: MICRO_BATCHES * MICRO_BATCH].view(MICRO_BATCHES, MICRO_BATCH)
        if step == die_at:
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()  # mid-step, no goodbye
        try:
            loss = pipeline_step(pipe, other, stage, layer, images[rows], labels[rows], step)
            flat = torch.cat([p.grad.flatten() for p in params])
            info = retried(lambda flat=flat: dp.all_reduce(flat, op="avg"))
            with torch.no_grad():
                for p, g in zip(params, torch.split(flat, [p.numel() for p in params])):
                    p -= LR * g.view_as(p)
                    p.grad = None
            state.revision = step + 1
            say(event="step", step=step, dp_world=info.world_size, loss=loss)
            time.sleep(pause)  # a bigger model's compute
            # A new replica is admitted whole: only once every stage's group has its newcomer, so
            # that its stages start pipelining at the same step. Each group's answer is the same
            # on all its members, so every replica's minimum is too.
            pending = torch.tensor([int(retried(dp.peers_pending))], dtype=torch.int32)
            pipe.all_reduce(pending, op="min")
        except (shoal.PeerLostError, shoal.UsageError) as e:
            # The partner died during a pipeline call (PeerLostError), or before one, which then
            # ran in the group re-formed without it, where its rank is gone (UsageError).
            if isinstance(e, shoal.UsageError) and pipe.group_world_size == STAGES:
                raise
            say(event="left", step=step, why=str(e))  # the pipeline is broken: this replica is done
            pipe.close()
            dp.close()
            return
        if pending[0]:
            retried(dp.update_topology)
    say(event="done", hashes=state.hashes())
    pipe.close()
    dp.close()


def demo(replicas: int, steps: int, pause: float) -> None:
    """The run described at the top, checked."""
    events: list[dict] = []
    seen = threading.Condition()
    procs: dict = {}

    def start(replica: int, stage: int, *extra: str) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--master", master.address, "--replica", str(replica),
               "--stage", str(stage), "--replicas", str(replicas), "--steps", str(steps), "--pause", str(pause),
               *extra]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs[(replica, stage)] = p

        def read() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                with seen:
                    events.append(json.loads(line))
                    seen.notify_all()
        threading.Thread(target=read, daemon=True).start()

    victim, newcomer = (replicas - 1, STAGES - 1), replicas
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=5.0) as master:
        for r in range(replicas):
            for s in range(STAGES):
                start(r, s, *(["--die-at", str(steps // 3)] if (r, s) == victim else []))
        for s in range(STAGES):
            start(newcomer, s, "--join")
        with seen:
            assert seen.wait_for(lambda: any(e.get("step", -1) >= steps // 2 for e in events), timeout=300)
        print(f"[demo] step {steps // 2}: a new replica ({newcomer}) connects", flush=True)
        for s in range(STAGES):
            stdin = procs[(newcomer, s)].stdin
            stdin.write("go\n")
            stdin.flush()
        codes = {key: p.wait(timeout=300) for key, p in procs.items()}
    for e in events:
        if e["event"] != "step" or e["step"] % 5 == 0 or e["dp_world"] != replicas:
            print(f"[demo] {e}")
    def by(kind: str) -> list[dict]:
        return [e for e in events if e["event"] == kind]

    assert codes[victim] == -signal.SIGKILL and all(c == 0 for k, c in codes.items() if k != victim), codes
    left = {(e["replica"], e["stage"]) for e in by("left")}
    assert left == {(victim[0], s) for s in range(STAGES) if (victim[0], s) != victim}, left
    done = by("done")
    assert len(done) == (replicas - 1) * STAGES + STAGES, done
    for s in range(STAGES):
        hashes = {json.dumps(e["hashes"], sort_keys=True) for e in done if e["stage"] == s}
        assert len(hashes) == 1, f"stage {s}'s replicas differ"
    worlds = [e["dp_world"] for e in by("step") if e["replica"] == 0 and e["stage"] == 0]
    shrunk = worlds.index(replicas - 1)
    assert worlds[0] == replicas and replicas in worlds[shrunk:], worlds
    assert all(e["fetched"] > 0 for e in by("joined")), by("joined")
    print(f"[demo] ok: replica {victim[0]} lost its stage {victim[1]} at step {steps // 3} and left; the others "
          f"went on with {replicas - 1}, replica {newcomer} caught up and joined, and every stage ended "
          "bit-identical on all its replicas")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", action="store_true", help="run the whole scenario on this machine")
    parser.add_argument("--master", default="127.0.0.1:48148")
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--stage", type=int, default=0, choices=range(STAGES))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--join", action="store_true", help="a replica that joins a run under way")
    parser.add_argument("--pause", type=float, default=0.05, help="seconds of pretended compute per step")
    parser.add_argument("--die-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.demo:
        demo(args.replicas, args.steps, args.pause)
    else:
        process(args.master, args.replica, args.stage, args.replicas, args.steps, args.join, args.die_at, args.pause)


if __name__ == "__main__":
    main()
