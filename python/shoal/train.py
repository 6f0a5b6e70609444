"""``shoal demo --train``: DiLoCo on a real dataset, with peers killed and joining mid-run.

An MLP learns to read handwritten digits (scikit-learn's 8×8 ``digits``, 1,797 images that ship
inside the package: nothing is downloaded). Every peer is a separate process that takes
``inner_steps`` AdamW steps on batches it draws from the training images, then the peers
average how far they moved (:class:`shoal.torch.DiLoCo`: an all-reduce, then SGD with Nesterov
momentum on the shared anchor). With ``churn``, this script SIGKILLs running peers from the
outside (a spot instance vanishing mid-step, maybe mid-all-reduce) and starts newcomers, which
the run admits at its next outer step: they receive the anchor, the outer momentum and the step
count from the others and train from there.

Printed live: each outer step's loss of the anchor on the 360 held-out images, the world size,
who was killed and who joined. The run with churn ends at the same held-out loss as the run
without, within the tolerance that ``python/tests/test_train.py`` checks.

    shoal demo --train                      # 4 peers, 2 killed, 2 joining
    shoal demo --train --no-churn           # the same run, nobody dies
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    import torch

TEST_IMAGES = 360


def digits() -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]":
    """The digits as (train images, train labels, held-out images, held-out labels): pixels
    scaled to [0, 1], the same split on every peer."""
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:TEST_IMAGES], order[TEST_IMAGES:]
    return x[train], y[train], x[test], y[test]


def model() -> "torch.nn.Module":
    """The MLP, initialised alike on every peer (a newcomer takes up the anchor anyway)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _peer(master: str, name: int, founders: int, outer_steps: int, inner_steps: int, pause: float,
          deadline: Optional[float] = None, seed: int = 0) -> None:
    import torch

    import shoal
    from shoal.torch import DiLoCo

    torch.set_num_threads(1)  # several peers share this machine's cores

    def say(**event: object) -> None:
        sys.stdout.write(json.dumps({"peer": name, **event}) + "\n")
        sys.stdout.flush()

    x, y, x_test, y_test = digits()
    net = model()
    if name >= founders:
        sys.stdin.readline()  # a newcomer, started ahead (imports take seconds): wait for the word
    comm = shoal.Communicator(master, timeout=60)
    # Founders wait for each other; a newcomer is admitted by the others' next outer step.
    comm.connect(timeout=120, min_world_size=founders if name < founders else 1)
    diloco = DiLoCo(comm, net.parameters(), inner_steps=inner_steps, outer_lr=0.7, outer_momentum=0.9,
                    deadline=deadline)
    _retry(diloco.join)
    say(event="joined", outer=diloco.outer_steps, world=comm.group_world_size)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    draw = torch.Generator().manual_seed(100 + name + 1000 * seed)  # each peer its own batches
    anchor = model()  # the anchor as a model, to score it on the held-out images
    while diloco.outer_steps < outer_steps:
        batch = torch.randint(len(x), (32,), generator=draw)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[batch]), y[batch]).backward()
        opt.step()
        if _retry(diloco.step):
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(diloco.anchor, anchor.parameters())
                out = anchor(x_test)
                loss = float(torch.nn.functional.cross_entropy(out, y_test))
                accuracy = float((out.argmax(1) == y_test).float().mean())
            say(event="outer", outer=diloco.outer_steps, loss=loss, accuracy=accuracy,
                world=comm.group_world_size, hash=shoal.hash_tensor(diloco.anchor),
                included=len(diloco.last_included))
            time.sleep(pause)
    _retry(diloco.finish)
    comm.close()
    say(event="done", outer=diloco.outer_steps)


def _retry(call: Callable[[], object]) -> object:
    """Calls ``call`` until it does not raise :class:`shoal.PeerLostError` (a peer died: the
    call changed nothing, and the run re-formed without it)."""
    import shoal

    while True:
        try:
            return call()
        except shoal.PeerLostError:
            continue


@dataclass
class Run:
    """What a run did: the events every peer printed, in arrival order, and the churn."""

    events: list = field(default_factory=list)
    killed: list = field(default_factory=list)
    joined: list = field(default_factory=list)

    def outer(self) -> list:
        return [e for e in self.events if e["event"] == "outer"]

    @property
    def final(self) -> dict:
        """The last outer step's record (every survivor's is the same anchor)."""
        return max(self.outer(), key=lambda e: e["outer"])

    def final_loss(self, last: int = 5) -> float:
        """The anchor's held-out loss averaged over the last ``last`` outer steps (one step's
        alone swings by ±10% here)."""
        losses = {e["outer"]: e["loss"] for e in self.outer()}
        return sum(losses[s] for s in sorted(losses)[-last:]) / last


def run(peers: int = 4, outer_steps: int = 60, inner_steps: int = 8, churn: bool = True, pause: float = 0.05,
        show: Callable[[str], None] = lambda line: None, timeout: float = 300, deadline: Optional[float] = None,
        straggler: Optional[int] = None, seed: int = 0) -> Run:
    """Trains with ``peers`` founders to ``outer_steps`` outer steps, each peer pausing ``pause``
    seconds after each (a bigger model's compute, so that the churn lands mid-run), founder
    ``straggler`` twice as long. With ``churn``, the last founder is killed at a quarter of the
    run and a newcomer comes in at a third; the next-to-last founder is killed at half and another
    newcomer comes in at 60%. ``deadline``: DiLoCo's (seconds). ``seed`` draws other batches.
    ``show`` gets a line per event (one per outer step, from the first peer to report it)."""
    import shoal

    schedule: list = []  # (outer step, "kill" founder | "start" newcomer, peer name), in order
    if churn and peers >= 2:
        schedule = [(outer_steps // 4, "kill", peers - 1), (outer_steps // 3, "start", peers)]
        if peers >= 3:
            schedule += [(outer_steps // 2, "kill", peers - 2), (outer_steps * 3 // 5, "start", peers + 1)]
    result = Run()
    progress = threading.Condition()
    procs: dict = {}
    shown: set = set()
    printing = threading.Lock()
    readers: list = []

    def say(line: str) -> None:
        with printing:
            show(line)

    def read(p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            event = json.loads(line)
            with progress:
                result.events.append(event)
                progress.notify_all()
                if event["event"] == "outer":
                    if event["outer"] in shown:
                        continue
                    shown.add(event["outer"])
            say(_describe(event))

    with shoal.Master("127.0.0.1:0") as master:
        for name in [*range(peers), *(name for _, what, name in schedule if what == "start")]:
            cmd = [sys.executable, "-m", "shoal.train", "--peer", str(name), "--master", master.address,
                   "--peers", str(peers), "--outer-steps", str(outer_steps), "--inner-steps", str(inner_steps),
                   "--pause", str(pause * (2 if name == straggler else 1)), "--seed", str(seed)]
            if deadline is not None:
                cmd += ["--deadline", str(deadline)]
            procs[name] = p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            readers.append(threading.Thread(target=read, args=(p,), daemon=True))
            readers[-1].start()
        deadline = time.monotonic() + timeout
        for at, what, name in schedule:
            with progress:
                progress.wait_for(lambda: any(e["outer"] >= at for e in result.outer()),
                                  timeout=max(0.0, deadline - time.monotonic()))
            if what == "kill":
                procs[name].send_signal(signal.SIGKILL)
                result.killed.append(name)
                say(f"[demo] outer step {at}: killed peer {name} (SIGKILL, no goodbye)")
            else:
                procs[name].stdin.write("go\n")
                procs[name].stdin.flush()
                result.joined.append(name)
                say(f"[demo] outer step {at}: peer {name} connects, a newcomer")
        try:
            codes = {name: p.wait(timeout=max(1.0, deadline - time.monotonic())) for name, p in procs.items()}
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise RuntimeError(f"the run did not end within {timeout} s") from None
    for reader in readers:
        reader.join()
    for p in procs.values():
        p.stdin.close()
        p.stdout.close()
    bad = {n: c for n, c in codes.items() if c != (-signal.SIGKILL if n in result.killed else 0)}
    if bad:
        raise RuntimeError(f"peers ended badly (name: exit code): {bad}")
    return result


def _describe(event: dict) -> str:
    peer = f"[peer {event['peer']}]"
    if event["event"] == "joined":
        return f"{peer} in the run at outer step {event['outer']}, world {event['world']}"
    if event["event"] == "outer":  # the anchor every peer holds
        part = f" ({event['included']} took part)" if 0 < event.get("included", 0) < event["world"] else ""
        return (f"[run] outer step {event['outer']:3d}: held-out loss {event['loss']:.4f}, "
                f"accuracy {event['accuracy']:.1%}, world {event['world']}{part}, anchor {event['hash'][:12]}")
    return f"{peer} finished at outer step {event['outer']}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="shoal demo --train", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--outer-steps", type=int, default=60)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.2,
                        help="seconds each peer waits after an outer step (a bigger model's compute)")
    parser.add_argument("--no-churn", action="store_true", help="nobody dies, nobody joins")
    parser.add_argument("--deadline", type=float, help="seconds DiLoCo's outer all-reduce waits for a late peer")
    parser.add_argument("--straggler", type=int, help="this founder pauses twice as long")
    parser.add_argument("--seed", type=int, default=0, help="draws other batches")
    parser.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer is not None:
        return _peer(args.master, args.peer, args.peers, args.outer_steps, args.inner_steps, args.pause, args.deadline,
                     args.seed)
    try:
        import sklearn  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"shoal demo --train needs torch and scikit-learn: pip install 'shoal[train]' ({e})")
    started = time.monotonic()
    result = run(args.peers, args.outer_steps, args.inner_steps, churn=not args.no_churn, pause=args.pause,
                 show=lambda line: print(line, flush=True), deadline=args.deadline, straggler=args.straggler,
                 seed=args.seed)
    final = result.final
    print(f"[demo] {final['outer']} outer steps in {time.monotonic() - started:.1f} s: held-out loss "
          f"{result.final_loss():.4f} (mean of the last 5), accuracy {final['accuracy']:.1%}, "
          f"world {final['world']}; killed {result.killed or 'nobody'}, joined {result.joined or 'nobody'}", flush=True)


if __name__ == "__main__":
    main()
