"""A peer of a chaos run (``chaos.py``): ``chaos_peer.py JSON_SPEC``.

It trains until the stop file appears, logging every call to a JSON-lines file as it ends (this
process may be killed at any instant, so nothing waits for the end). Each round:

1. an all-reduce of a known pattern (the round's anchor: its topology, sequence, world and rank
   are what every member of the group agrees on, so what follows is derived from them alone);
2. six operations in flight together, each with its own tag: an int8-quantized all-reduce, an
   all-gather, a broadcast from a root drawn from the anchor, a reduce-scatter, and a send to and
   a receive from the members a shift drawn from the anchor away (every member sends and
   receives one message a round, so the pairs change from round to round);
3. a sync of a shared state that moved with the anchor's result, so a newcomer (arriving with
   zeros, or caught up in the background before its admission with ``catch_up``) is repaired,
   and every peer's state must hash the same at every revision;
4. now and then, as the anchor decides for every member alike, ``peers_pending`` (and
   ``update_topology`` if someone waits) or ``optimize_topology``.

After a failed call the round starts over (the README's loop); after a ``PeerLostError`` a peer
(not a ``retry_only`` one) votes ``update_topology`` first (PCCL's loop). ``chaos.py`` checks the log afterwards:
every record says what it needs to be checked alone (a key the other participants share, a hash
of the result, whether it was right, whether a failed call restored its buffers).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from typing import Any, Callable

import numpy as np

import shoal

PATTERN = (np.arange(1 << 18) % 13 + 1).astype(np.float32)
BLOCK = 256  # elements of each member's block in the all-gather and the reduce-scatter
P2P = 1024  # elements of each message
STATE = 1 << 16
QUANTIZED = PATTERN[: 1 << 14]
# How far an int8 all-reduce may drift from the exact sum, per member and hop: each hop rounds a
# 128-element block of partial sums to 255 steps between its min and max (at most 13 per member).
INT8_STEP = 13 / 255


def mix(topology: int, sequence: int) -> int:
    """A number every member derives from the anchor alike (Python's hash of a str is salted)."""
    return int.from_bytes(hashlib.sha256(f"{topology}:{sequence}".encode()).digest()[:8], "little")


def message(group: int, topology: int, sequence: int, src: int, dst: int) -> np.ndarray:
    """What rank ``src`` sends rank ``dst`` in a round: the receiver can tell it intact."""
    seed = mix(topology, sequence) ^ (group << 40) ^ (src << 20) ^ dst
    return np.random.default_rng(seed).standard_normal(P2P).astype(np.float32)


def sha(x: np.ndarray) -> str:
    return hashlib.sha256(x.tobytes()).hexdigest()


class Round:
    """The operations in flight after an anchor: each started at once, then waited for in turn."""

    def __init__(self, comm: shoal.Communicator, group: int, anchor: Any, record: Callable[..., None]) -> None:
        self.comm, self.record, self.group, self.topology = comm, record, group, anchor.topology
        n, r, topology, sequence = anchor.world_size, anchor.rank, anchor.topology, anchor.sequence
        m = mix(topology, sequence)
        self.ops: list[tuple] = []
        key = [group, topology, sequence]

        q = QUANTIZED.copy()
        self.start("all_reduce_int8", lambda: comm.all_reduce_async(q, op="sum", tag=1, quantization="int8"),
                   lambda i: {"key": key + [1], "world": i.world_size, "sha": sha(q),
                              "correct": bool(np.abs(q - QUANTIZED * i.world_size).max()
                                              <= INT8_STEP * i.world_size * i.world_size)},
                   lambda: bool((q == QUANTIZED).all()))

        gathered = np.zeros(n * BLOCK, np.float32)
        mine = PATTERN[:BLOCK] + r
        expected = np.concatenate([PATTERN[:BLOCK] + k for k in range(n)])
        self.start("all_gather", lambda: comm.all_gather_async(gathered, mine, tag=2),
                   lambda i: {"key": key + [2], "sha": sha(gathered), "correct": bool((gathered == expected).all())},
                   lambda: not gathered.any())

        root = m % n
        sent = PATTERN[:P2P] * (root + 1)
        b = sent.copy() if r == root else np.zeros(P2P, np.float32)
        before = b.copy()
        self.start("broadcast", lambda: comm.broadcast_async(b, root=root, tag=3),
                   lambda i: {"key": key + [3], "sha": sha(b), "correct": bool((b == sent).all())},
                   lambda: bool((b == before).all()))

        scattered = np.zeros(BLOCK, np.float32)
        spread = np.tile(PATTERN[:BLOCK] * (r + 1), n)  # every block alike: every member's result too
        self.start("reduce_scatter", lambda: comm.reduce_scatter_async(scattered, spread, op="sum", tag=4),
                   lambda i: {"key": key + [4], "sha": sha(scattered),
                              "correct": bool((scattered == PATTERN[:BLOCK] * (n * (n + 1) // 2)).all())},
                   lambda: not scattered.any())

        if n > 1:
            shift = 1 + m % (n - 1)
            to, frm = (r + shift) % n, (r - shift) % n
            out = message(group, topology, sequence, r, to)
            self.start("send", lambda: comm.isend(out, peer=to, tag=5),
                       lambda i: {"sent": key + [r, to], "sha": sha(out)}, lambda: True,
                       failed={"sent": key + [r, to]})
            inbox = np.zeros(P2P, np.float32)
            want = message(group, topology, sequence, frm, r)
            self.start("recv", lambda: comm.irecv(inbox, peer=frm, tag=5),
                       lambda i: {"received": key + [frm, r], "sha": sha(inbox),
                                  "correct": bool((inbox == want).all())},
                       lambda: True, failed={"received": key + [frm, r]})

    def start(self, name: str, call: Callable[[], Any], done: Callable[[Any], dict], restored: Callable[[], bool],
              failed: dict | None = None) -> None:
        started = time.time()
        try:
            work = call()
        except shoal.ShoalError as e:
            work = e
        self.ops.append((name, started, work, done, restored, failed or {}))

    def wait(self) -> list[BaseException]:
        """Wait for every operation, recording each; the errors they ended with."""
        errors = []
        for name, started, work, done, restored, failed in self.ops:
            try:
                if isinstance(work, BaseException):
                    raise work
                info = work.wait()
                fields = done(info)
                if info.topology != self.topology:
                    # A new topology came into force between the anchor and this call: it ran
                    # among other members or ranks than the round planned (a broadcast's root, a
                    # transfer's partner), so only its agreement among its participants tells.
                    fields = {k: v for k, v in fields.items() if k not in ("correct", "sent", "received")}
                    fields["replanned"] = True
                    if "key" in fields:
                        fields["key"] = [self.group, info.topology, info.sequence, fields["key"][-1]]
                self.record(call=name, seconds=time.time() - started, **fields)
            except (shoal.PeerLostError, shoal.UsageError) as e:
                self.record(call=name, seconds=time.time() - started, error=type(e).__name__, restored=restored(),
                            msg=str(e), **failed)
                errors.append(e)
        return errors


def main(spec: dict) -> None:
    comm = shoal.Communicator(spec["master"], peer_group=spec["group"], timeout=spec["call_timeout"],
                              heartbeat_timeout=spec.get("heartbeat_timeout"))
    log = open(spec["log"], "a")

    def record(**fields: Any) -> None:
        fields.setdefault("at", round(time.time(), 3))  # beside chaos.py's actions.txt
        log.write(json.dumps(fields) + "\n")
        log.flush()

    def timed(name: str, call: Callable[[], Any]) -> Any:
        started = time.time()
        try:
            return call()
        finally:
            record(call=name, seconds=time.time() - started)

    w = np.zeros(STATE, np.float32)
    state, synced = shoal.SharedState({"w": w}), 0
    try:
        connecting = True
        if spec.get("catch_up"):
            caught = timed("connect", lambda: comm.connect(timeout=spec["call_timeout"], catch_up=state))
            if caught.revision is not None:
                # The group's elected state at that revision: it must hash as the members' did.
                synced = caught.revision
                record(revision=synced, state=shoal.hash_tensor(w), caught_up=caught.fetched_bytes)
        else:
            timed("connect", lambda: comm.connect(timeout=spec["call_timeout"]))
        connecting = False
        # ``then``: the call after the sync, as the last anchor decided.
        next_call, then, resume, vote_first = "all_reduce", "all_reduce", False, False
        while not os.path.exists(spec["stop"]):
            doing = "update_topology" if vote_first else next_call
            try:
                if vote_first:
                    vote_first = False
                    timed("update_topology", comm.update_topology)
                elif next_call == "peers_pending":
                    next_call = "update_topology" if timed("peers_pending", comm.peers_pending) else "all_reduce"
                elif next_call in ("update_topology", "optimize_topology"):
                    timed(next_call, getattr(comm, next_call))
                    next_call = "all_reduce"
                elif next_call == "sync":
                    # The revision the run moves to; a peer behind (a newcomer) is repaired.
                    state.revision = synced + 1
                    info = timed("sync", lambda: comm.sync_shared_state(state, override_resume=resume))
                    resume = False
                    synced = info.revision
                    record(revision=synced, state=shoal.hash_tensor(w), received=sorted(info.received))
                    next_call = then
                else:
                    x = PATTERN.copy()
                    anchor = timed("all_reduce", lambda: comm.all_reduce(x, op="sum"))
                    record(key=[spec["group"], anchor.topology, anchor.sequence, 0], world=anchor.world_size,
                           correct=bool((x == PATTERN * anchor.world_size).all()), sha=sha(x))
                    w += x[: w.size] * 1e-3
                    lost = [e for e in Round(comm, spec["group"], anchor, record).wait()
                            if isinstance(e, shoal.PeerLostError)]
                    vote_first = bool(lost) and not spec.get("retry_only")
                    m = mix(anchor.topology, anchor.sequence)
                    then = "optimize_topology" if m % 29 == 0 else "peers_pending" if m % 4 == 0 else "all_reduce"
                    next_call = "sync"
            except (shoal.PeerLostError, shoal.UsageError) as e:
                restored = doing != "all_reduce" or bool((x == PATTERN).all())
                record(error=type(e).__name__, restored=restored, msg=str(e), call=doing)
                # Every peer that held the run's state (revision R) is gone: go on from ours at
                # R + 1, as an application would from a checkpoint of R, so that a revision never
                # names two different states.
                lost_state = re.search(r"last agreed on \(revision (\d+)\)", str(e))
                if lost_state:
                    resume, synced = True, int(lost_state.group(1))
                vote_first = isinstance(e, shoal.PeerLostError) and not spec.get("retry_only")
                # The round starts over, where every member that failed meets the others (a
                # failure inside optimize_topology, say, reaches some members sooner than others)
                # and the newcomers a vote admitted begin: the README's loop, `continue`.
                next_call = "all_reduce"
    except shoal.KickedError as e:
        record(kicked=str(e))
    except shoal.MasterUnreachableError as e:
        # Its host was partitioned, or it dialed while the master restarted: chaos.py checks that.
        record(master_unreachable=str(e), connecting=connecting)
    except shoal.ShoalError as e:
        record(fatal=f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
