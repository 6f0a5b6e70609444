"""``shoal demo``: a master and peers on this machine; peers join one by one, share a model,
all-reduce, and one of them dies.

Each peer is a separate process holding a "gradient" filled with its own number. Every step it
syncs the shared model (a newcomer arrives with zeros and is repaired from the others), averages
the gradient with the peers present (the printed mean shows who is in the run) and updates the
model. Peers already in the run admit each newcomer with ``peers_pending()`` /
``update_topology()``. A few steps after everyone is in, the last peer kills itself (SIGKILL: no
goodbye); the master re-forms the ring without it, and the others carry on: a call that was under
way fails with ``PeerLostError`` and is simply retried.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

import numpy as np


def _peer(master: str, name: int, peers: int, steps_after_full: int, elements: int, dies: bool) -> None:
    import shoal

    def say(msg: str) -> None:
        # One write per line, so that the peers' lines do not interleave.
        sys.stdout.write(f"[peer {name}] {msg}\n")
        sys.stdout.flush()

    from ._state import progress_line

    quarter = [0]

    def progress(p: "shoal.CatchUpProgress") -> None:
        # A bar per quarter, each on its own line: the peers share one terminal.
        if p.total and p.done * 4 // p.total > quarter[0]:
            quarter[0] = p.done * 4 // p.total
            say(progress_line(p, width=20))

    with shoal.Communicator(master) as comm:
        model = np.zeros(elements, dtype=np.float32)
        state = shoal.SharedState({"model": model})
        say("connecting to the master")
        # A newcomer fetches the model from the peers in the run while they go on training, and is
        # admitted only then: the sync that admits it moves only what changed since.
        caught = comm.connect(timeout=60, catch_up=state, progress=progress)
        if caught is not None and caught.revision is not None:
            say(f"caught up with revision {caught.revision} ({caught.fetched_bytes >> 10} KiB from peers "
                f"{caught.donors} in {caught.elapsed * 1e3:.0f} ms) while they trained")
        say(f"accepted as rank {comm.rank} of {comm.group_world_size}")
        step, full_since, world = state.revision, None, comm.group_world_size
        # Every accepted peer makes the same calls in the same order: sync, all_reduce, the
        # peers_pending vote, then (if it says so) update_topology. A newcomer's connect()
        # returns when that update commits, so it enters the loop at the sync.
        while full_since is None or step - full_since < steps_after_full:
            if dies and full_since is not None and step - full_since == 2:
                say("crashing now (SIGKILL)")
                os.kill(os.getpid(), signal.SIGKILL)
            grad = np.full(elements, float(name), dtype=np.float32)
            try:
                state.revision = step
                synced = comm.sync_shared_state(state)
                if synced.received:
                    say(f"model repaired at revision {synced.revision} from peers {synced.received['model']}")
                step = state.revision
                info = comm.all_reduce(grad, op="avg")
            except shoal.PeerLostError as e:
                # The call did not happen (buffers restored); the ring re-forms by itself.
                say(f"step {step} failed: {e}; retrying it")
                continue
            model -= 0.1 * grad
            if info.world_size < world:
                say(f"the run went on without the lost peer: now rank {comm.rank} of {info.world_size}")
            world = info.world_size
            say(
                f"step {step:2d}: all_reduce(avg) over {info.world_size} peers -> {grad[0]:.3f} "
                f"({grad.nbytes >> 10} KiB in {info.elapsed * 1e3:.2f} ms); model hash {shoal.hash_tensor(model)[:12]}"
            )
            if full_since is None and comm.group_world_size == peers:
                full_since = step
            step += 1
            time.sleep(0.15)
            if comm.peers_pending():
                say("peers are pending: voting to admit them")
                comm.update_topology()
                say(f"now rank {comm.rank} of {comm.group_world_size}")
        say("done, leaving the run")


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--train" in argv:
        from . import train

        return train.main([a for a in argv if a != "--train"])
    parser = argparse.ArgumentParser(prog="shoal demo", description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true",
                        help="instead: DiLoCo training an MLP on real data with churn (shoal demo --train --help)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--join-interval", type=float, default=1.0, help="seconds between joins")
    parser.add_argument("--steps", type=int, default=8, help="steps once everyone is in")
    parser.add_argument("--elements", type=int, default=1 << 18)
    parser.add_argument("--no-death", action="store_true", help="nobody dies")
    parser.add_argument("--http", default="127.0.0.1:0", metavar="ADDR",
                        help="where the master serves its status page (default: a free port on 127.0.0.1)")
    parser.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer is not None:
        dies = not args.no_death and args.peers > 1 and args.peer == args.peers - 1
        return _peer(args.master, args.peer, args.peers, args.steps, args.elements, dies)

    os.environ.setdefault("SHOAL_LOG", "info")  # the master's log shows membership changes
    import shoal

    from .status import render

    with shoal.Master("127.0.0.1:0", http_addr=args.http) as master:
        print(f"[demo] master listening on {master.address}; watch the run at http://{master.http_address}/",
              flush=True)
        env = {k: v for k, v in os.environ.items() if k != "SHOAL_LOG"}
        procs = []
        for i in range(args.peers):
            print(f"[demo] starting peer {i}", flush=True)
            cmd = [sys.executable, "-m", "shoal.demo", "--peer", str(i), "--master", master.address]
            cmd += ["--peers", str(args.peers), "--steps", str(args.steps), "--elements", str(args.elements)]
            cmd += ["--no-death"] if args.no_death else []
            procs.append(subprocess.Popen(cmd, env=env))
            time.sleep(args.join_interval)
        codes = [p.wait(timeout=300) for p in procs]
        status = master.status()
        if status is not None:
            print("[demo] the master's view at the end (shoal status):\n" + render(status), flush=True)
    # The peer that crashed on purpose ends with SIGKILL; every other must end cleanly.
    expected = [0] * args.peers
    if not args.no_death and args.peers > 1:
        expected[-1] = -signal.SIGKILL
    if codes != expected:
        raise SystemExit(f"[demo] a peer failed: exit codes {codes}, expected {expected}")
    survivors = args.peers - (expected[-1] != 0)
    print(f"[demo] {survivors} of {args.peers} peers finished; the rest crashed as planned", flush=True)


if __name__ == "__main__":
    main()
