"""A pipeline-parallel model trained with the 1F1B schedule over shoal's tagged send and recv.

Run one process per stage against a master (``shoal master --listen 127.0.0.1:48148``)::

    python examples/pipeline_1f1b.py --master 127.0.0.1:48148 --stages 4

Each process owns one layer (``tanh(x @ W)``; the last also the loss). Micro-batches flow forward
from stage 0 to the last and their gradients flow back; every stage runs its warm-up forwards,
then alternates one forward and one backward, then drains the backwards (1F1B), so at most
``stages`` micro-batches' activations are alive on any stage. Activations travel with tag
``2 * micro_batch``, gradients with ``2 * micro_batch + 1``: each receive is matched by (peer, tag),
whatever order the sends went out in. After a few SGD steps every stage checks its layer against
the same model trained without a pipeline, micro-batch by micro-batch, in this process.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import shoal

WIDTH, MICRO_BATCH, MICRO_BATCHES, STEPS, LR = 64, 8, 8, 3, 0.01


def model(stages: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The layers' initial weights, the inputs and the targets (the same in every process)."""
    rng = np.random.default_rng(1234)
    weights = [rng.normal(0, 1 / np.sqrt(WIDTH), (WIDTH, WIDTH)) for _ in range(stages)]
    x = rng.normal(size=(STEPS, MICRO_BATCHES, MICRO_BATCH, WIDTH))
    y = rng.normal(size=(STEPS, MICRO_BATCHES, MICRO_BATCH, WIDTH))
    return weights, x, y


def forward(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.tanh(x @ w)


def backward(w: np.ndarray, x: np.ndarray, out: np.ndarray, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of the layer's weight and input, given its output's."""
    grad_pre = grad_out * (1 - out * out)
    return x.T @ grad_pre, grad_pre @ w.T


def loss_grad(out: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    diff = out - target
    return 0.5 * float((diff * diff).sum()) / MICRO_BATCHES, diff / MICRO_BATCHES


def unpipelined(stages: int) -> tuple[list[np.ndarray], list[float]]:
    """The same training in one process: the reference."""
    weights, xs, ys = model(stages)
    losses = []
    for step in range(STEPS):
        grads = [np.zeros_like(w) for w in weights]
        loss = 0.0
        for m in range(MICRO_BATCHES):
            acts = [xs[step, m]]
            for w in weights:
                acts.append(forward(w, acts[-1]))
            part, g = loss_grad(acts[-1], ys[step, m])
            loss += part
            for s in reversed(range(stages)):
                gw, g = backward(weights[s], acts[s], acts[s + 1], g)
                grads[s] += gw
        for w, g in zip(weights, grads):
            w -= LR * g
        losses.append(loss)
    return weights, losses


def one_step(comm: shoal.Communicator, stages: int, w: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> float:
    """One 1F1B step of this process's stage over the micro-batches ``xs`` (targets ``ys``):
    updates ``w`` in place; returns the loss (on the last stage; 0 elsewhere)."""
    stage = comm.rank
    first, last = stage == 0, stage == stages - 1
    grad_w = np.zeros_like(w)
    inputs: dict[int, np.ndarray] = {}
    outputs: dict[int, np.ndarray] = {}
    sends: list[shoal.Work] = []
    loss = 0.0

    def run_forward(m: int) -> None:
        x = xs[m] if first else np.empty((MICRO_BATCH, WIDTH))
        if not first:
            comm.recv(x, peer=stage - 1, tag=2 * m)
        out = forward(w, x)
        inputs[m], outputs[m] = x, out
        if not last:
            sends.append(comm.isend(out, peer=stage + 1, tag=2 * m))

    def run_backward(m: int) -> None:
        nonlocal loss
        out = outputs.pop(m)
        if last:
            part, grad_out = loss_grad(out, ys[m])
            loss += part
        else:
            grad_out = np.empty_like(out)
            comm.recv(grad_out, peer=stage + 1, tag=2 * m + 1)
        gw, grad_in = backward(w, inputs.pop(m), out, grad_out)
        grad_w[...] += gw
        if not first:
            sends.append(comm.isend(grad_in, peer=stage - 1, tag=2 * m + 1))

    # Warm-up forwards, then one forward and one backward at a time, then the last backwards.
    warmup = min(stages - stage - 1, MICRO_BATCHES)
    for m in range(warmup):
        run_forward(m)
    for m in range(MICRO_BATCHES - warmup):
        run_forward(warmup + m)
        run_backward(m)
    for m in range(MICRO_BATCHES - warmup, MICRO_BATCHES):
        run_backward(m)
    for work in sends:
        work.wait()
    w -= LR * grad_w
    return loss


def train_stage(comm: shoal.Communicator, stages: int) -> tuple[np.ndarray, list[float]]:
    """This process's stage of the pipeline, trained with 1F1B; the last stage's losses."""
    weights, xs, ys = model(stages)
    w = weights[comm.rank]
    losses = [one_step(comm, stages, w, xs[step], ys[step]) for step in range(STEPS)]
    return w, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--master", default="127.0.0.1:48148")
    parser.add_argument("--stages", type=int, default=4)
    args = parser.parse_args()
    with shoal.Communicator(args.master, timeout=60) as comm:
        comm.connect(timeout=60)
        # Admit the other stages: the first process is accepted alone, the others by a vote.
        while comm.group_world_size < args.stages:
            comm.all_reduce(np.ones(1, np.float32), op="sum")
            if comm.peers_pending():
                comm.update_topology()
            else:
                time.sleep(0.02)
        stage = comm.rank
        started = time.perf_counter()
        w, losses = train_stage(comm, args.stages)
        elapsed = time.perf_counter() - started
        reference, reference_losses = unpipelined(args.stages)
        same = np.allclose(w, reference[stage], rtol=1e-12, atol=1e-14)
        if stage == args.stages - 1:
            same = same and np.allclose(losses, reference_losses, rtol=1e-12)
            print(f"stage {stage}: losses {', '.join(f'{x:.4f}' for x in losses)}")
        # Nobody leaves (closing its streams) before every stage is done.
        comm.barrier()
    if not same:
        raise SystemExit(f"stage {stage}: the pipeline's layer differs from the unpipelined model's")
    print(f"stage {stage}: {STEPS} steps of {MICRO_BATCHES} micro-batches in {elapsed * 1e3:.0f} ms; "
          "matches the unpipelined model")


if __name__ == "__main__":
    main()
