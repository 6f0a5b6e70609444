"""A torch.distributed DDP program on shoal that survives churn: scikit-learn's digits, an MLP,
AdamW, launched by ``torchrun``; workers may be SIGKILLed and new ones started at any time.

    shoal master --listen 127.0.0.1:48148 &
    export SHOAL_MASTER=127.0.0.1:48148
    # three founders, one torchrun each (a torchrun stops all its workers when one dies):
    SHOAL_MIN_WORLD_SIZE=3 torchrun --standalone --nproc-per-node 1 examples/torchrun_elastic.py &  # x3
    # later, a newcomer: admitted at the run's next admission step, it takes up the run's state
    torchrun --standalone --nproc-per-node 1 examples/torchrun_elastic.py

What differs from a plain DDP script: ``import shoal.torch``, the backend name, and the step run
through :class:`shoal.torch.Elastic`. Prints one JSON line per event (``started``, ``step`` every
ten steps, ``done`` with the held-out loss and a hash of the parameters, the same on every
worker).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import shoal
import shoal.torch
import torch
import torch.distributed as dist
from shoal.train import digits, model
from torch.nn.parallel import DistributedDataParallel


def say(**event: object) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--admit-every", type=int, default=5)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds of extra compute per step")
    parser.add_argument("--wait-for", type=Path, help="start only once this file exists")
    args = parser.parse_args()
    torch.set_num_threads(1)  # several workers share this machine's cores
    x, y, x_test, y_test = digits()
    net = model()
    if args.wait_for is not None:
        while not args.wait_for.exists():
            time.sleep(0.05)

    dist.init_process_group("shoal")
    ddp = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    elastic = shoal.torch.Elastic(ddp, optimizer, admit_every=args.admit_every)
    comm = elastic.comm
    say(event="started", pid=os.getpid(), peer=comm.peer_id, step=elastic.steps, world=comm.group_world_size)
    draw = torch.Generator().manual_seed(100 + comm.peer_id)  # each worker its own batches

    def train() -> float:
        batch = torch.randint(len(x), (32,), generator=draw)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        return float(loss)

    world = comm.group_world_size
    while elastic.steps < args.steps:
        loss = elastic.step(train)
        if elastic.steps % 10 == 0 or comm.group_world_size != world:
            world = comm.group_world_size
            say(event="step", step=elastic.steps, loss=loss, world=world)
        time.sleep(args.pause)

    with torch.no_grad():
        out = net(x_test)
        held_out = float(torch.nn.functional.cross_entropy(out, y_test))
        accuracy = float((out.argmax(1) == y_test).float().mean())
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    say(event="done", step=elastic.steps, loss=held_out, accuracy=accuracy, hash=shoal.hash_tensor(params),
        world=comm.group_world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
