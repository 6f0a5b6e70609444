"""A peer that dies (SIGKILL) or freezes (SIGSTOP) during an all-reduce loop: the survivors'
calls fail with PeerLostError within a bound instead of hanging, and after update_topology
the run goes on with the smaller world. A frozen peer that wakes learns it was expelled."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Optional, Union

import pytest
from conftest import clean_env, release, start_ready, worker_argv
from proxy import Proxy

import shoal

# 1 s works alone, but under the full suite on 2 shared cores a survivor was once expelled for
# silence: 2 s keeps the test about failure handling, not about scheduling.
HEARTBEAT_TIMEOUT = 2.0


def start_survivors(master: Union[shoal.Master, str], peers: int, special: Optional[dict] = None,
                    launch: Callable[[int, list[str]], list[str]] = lambda i, argv: argv, transport: str = "auto",
                    **params) -> list[subprocess.Popen]:
    """Starts ``peers`` survive workers (``launch`` may wrap peer i's command, ``params`` go into
    every spec) linked by ``transport`` (``SHOAL_TRANSPORT``); peer 1 gets ``special`` merged
    into its spec."""
    address = master if isinstance(master, str) else master.address
    procs = []
    for i in range(peers):
        spec = {"master": address, "index": i, "peers": peers, "steps_after": 5, **params}
        if i == 1 and special:
            spec.update(special)
        procs.append(subprocess.Popen(launch(i, worker_argv("survive", spec)), stdout=subprocess.PIPE, text=True,
                                      env={**clean_env(), "SHOAL_TRANSPORT": transport}))
        time.sleep(0.2)
    for p in procs:
        assert "ready" in p.stdout.readline(), "a peer did not join"
    time.sleep(0.3)  # let them all-reduce for a while
    return procs


def result(p: subprocess.Popen, timeout: float = 60) -> dict:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("transport", ["auto", "tcp"], ids=["shm", "tcp"])
@pytest.mark.parametrize("retry_only", [False, True], ids=["update_topology", "retry_only"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_survivors_fail_fast_and_carry_on_without_the_lost_peer(sig, retry_only, transport):
    """Both loop shapes recover: one that votes update_topology after the error, and one that
    simply retries (the master re-forms the ring by itself; a retry once failed forever). Over
    shared memory (peers on one host) and over TCP, the latter in a peer group other than 0."""
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT) as master:
        group = 6 if transport == "tcp" else 0
        procs = start_survivors(master, 3, retry_only=retry_only, transport=transport, group=group)
        victim, survivors = procs[1], [procs[0], procs[2]]
        lost_at = time.time()
        victim.send_signal(sig)
        try:
            outcomes = [result(p) for p in survivors]
        finally:
            if sig == signal.SIGSTOP:
                victim.send_signal(signal.SIGCONT)
        for o in outcomes:
            assert o["world"] == 2 and o["smaller"] == 5, o
            # Bounded by the heartbeat timeout (frozen) or the closed connections (killed), not
            # by the 60 s call timeout. Generous: the machine is shared. A survivor may see no
            # error at all (the victim stopped between collectives, or after sending its part,
            # and the master committed that collective without it).
            assert o["recovered_at"] - lost_at < HEARTBEAT_TIMEOUT + 4, o
            # At most one failed collective, then the smaller world: no error storm.
            assert len(o["errors"]) <= 1, o["errors"]
            # The lanes of the lost topology are unmapped: one out and one in, to the other
            # survivor, over shared memory (their memory is freed once nobody maps it).
            assert o["lane_segments"] == (2 if transport == "auto" else 0), o
        if sig == signal.SIGSTOP:
            woken = result(victim)
            assert "kicked" in woken and "no message for 2.0 s" in woken["kicked"], woken
        else:
            victim.communicate(timeout=10)  # reaps it and closes its pipe


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_losing_the_master_ends_every_call_on_every_peer(sig):
    env = clean_env()
    master = subprocess.Popen([sys.executable, "-m", "shoal.cli", "master", "--listen", "127.0.0.1:0",
                               "--heartbeat-timeout", "10"], stdout=subprocess.PIPE, text=True, env=env)
    peer_timeout = 1.5
    try:
        address = master.stdout.readline().split()[-1]
        procs = []
        for i in range(3):
            spec = {"master": address, "index": i, "peers": 3, "heartbeat_timeout": peer_timeout}
            procs.append(subprocess.Popen(worker_argv("master_loss", spec),
                                          stdout=subprocess.PIPE, text=True, env=env))
        for p in procs:
            assert "ready" in p.stdout.readline(), "a peer did not join"
        lost_at = time.time()
        master.send_signal(sig)
        outcomes = [result(p) for p in procs]
    finally:
        master.kill()
        master.communicate(timeout=10)
    for o in outcomes:
        assert "at" in o, o
        # A killed master closes its connections: noticed at once. A frozen one is noticed by
        # the missing heartbeats, within the peers' heartbeat timeout.
        assert o["at"] - lost_at < peer_timeout + 3, o
        assert all(v.startswith("MasterUnreachableError after 0.0") for v in o["later"].values()), o


def test_a_cut_off_peer_is_expelled_and_the_others_carry_on():
    # Peer 1 reaches the master, and is reached by its predecessor, only through proxies that
    # then stop forwarding: the path is blackholed, nothing closes.
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT) as master:
        control = Proxy(master.address)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        data = Proxy(f"127.0.0.1:{port}")
        special = {"master": control.address, "listen": f"127.0.0.1:{port}", "advertise": data.address,
                   "heartbeat_timeout": HEARTBEAT_TIMEOUT}
        try:
            procs = start_survivors(master, 3, special)
            victim, survivors = procs[1], [procs[0], procs[2]]
            cut_at = time.time()
            control.blackhole.set()
            data.blackhole.set()
            outcomes = [result(p) for p in survivors]
            cut_off = result(victim)
        finally:
            control.close()
            data.close()
    for o in outcomes:
        assert o["world"] == 2 and o["smaller"] == 5, o
        assert o["recovered_at"] - cut_at < HEARTBEAT_TIMEOUT + 4, o
        assert len(o["errors"]) <= 1, o["errors"]
    # It hears nothing more from the master: it declares it lost within its own timeout.
    assert "master_unreachable" in cut_off or "kicked" in cut_off, cut_off


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_barrier_fails_fast_when_a_member_dies_or_freezes_before_it(sig):
    """The victim never enters the barrier (no failpoint fires in one): the survivors fail, not
    pass it, since the victim's byte never reached them (it once passed: a barrier moved no data,
    so its lap, broken by the loss, committed like a collective whose data had all moved)."""
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT) as master:
        specs = [{"master": master.address, "index": i, "peers": 3, "victim": 1,
                  "heartbeat_timeout": HEARTBEAT_TIMEOUT} for i in range(3)]
        procs = start_ready("barrier_lost", specs)
        time.sleep(0.3)  # the survivors wait in the barrier
        lost_at = time.time()
        procs[1].send_signal(sig)
        try:
            for p in (procs[0], procs[2]):
                r = result(p)
                assert "at" in r and r["at"] - lost_at < HEARTBEAT_TIMEOUT + 4, r
                assert r["world"] == 2, r
        finally:
            release(procs[1], sig)


@pytest.mark.parametrize("point,algorithm,verb", [
    ("connect.before_ready", None, None), ("update_topology.before_ready", None, None),
    ("peers_pending.after_vote", None, None), ("all_reduce.reduce_scatter", "ring", None),
    ("all_reduce.all_gather", "ring", None), ("all_reduce.reduce_scatter", "oneshot", None),
    ("all_reduce.reduce_scatter", "ring", "broadcast"), ("all_reduce.reduce_scatter", "twoshot", None),
    ("all_reduce.reduce_scatter", "ring", "all_gather"), ("all_reduce.reduce_scatter", "ring", "reduce_scatter"),
    ("optimize_topology.probe", None, None), ("optimize_topology.before_vote", None, None),
])
def test_a_peer_dying_at_any_step_ends_every_call_and_the_run_goes_on(point, algorithm, verb):
    # Admission calls complete without the dead peer (they never need its data); a collective
    # fails on every survivor with its buffer restored. Either way the next all-reduce succeeds
    # in the smaller world.
    die_at(point, algorithm, verb)


@pytest.mark.parametrize("point,algorithm", [
    ("all_reduce.reduce_scatter", "ring"), ("all_reduce.all_gather", "ring"), ("all_reduce.reduce_scatter", "oneshot"),
    ("all_reduce.reduce_scatter", "twoshot"),
])
def test_a_quantized_collective_cut_by_a_death_restores_every_input(point, algorithm):
    # A quantized collective also replaces what it sent by its decoded values: its input still
    # comes back whole.
    die_at(point, algorithm, None, quantization="int8")


def die_at(point: str, algorithm: Optional[str], verb: Optional[str], quantization: Optional[str] = None) -> None:
    """Four peers; the last dies at ``point`` of a call made with ``algorithm`` (a collective:
    ``verb``, else an all-reduce, with ``quantization``): every survivor's call ends within the
    heartbeat timeout (a collective's with its buffer restored), and the next succeeds."""
    env = clean_env()
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT) as master:
        victim = 3
        procs = []
        for i in range(4):
            # One-shot sends its whole buffer at once, a broadcast passes it on whole: a large one
            # (in small chunks), so that the victim dies with most of it still to move.
            large = algorithm in ("oneshot", "twoshot") or verb is not None
            spec = {"master": master.address, "index": i, "peers": 4, "victim": victim, "failpoint": point,
                    "algorithm": algorithm, "verb": verb, "size": 4_000_000 if large else 100_000,
                    "quantization": quantization,
                    "chunk_bytes": 65536 if verb is not None else None}
            procs.append(subprocess.Popen(worker_argv("die_at", spec),
                                          stdout=subprocess.PIPE, text=True, env=env))
            if point.startswith("connect") and i == victim - 1:
                for p in procs:
                    assert "ready" in p.stdout.readline()
        survivors = [result(p) for p in procs[:victim]]
        procs[victim].communicate(timeout=30)
        assert procs[victim].returncode not in (0, 1), "the victim did not die at the failpoint"
    for s in survivors:
        first, *rest = s["calls"]
        assert first["seconds"] < HEARTBEAT_TIMEOUT + 4, first
        if point.startswith("all_reduce"):
            assert "error" in first and first["restored"], first
        if point == "optimize_topology.probe":
            assert "error" in first, first
        final = rest[-1]
        assert final.get("ok") and final["world"] == 3 and final["sum"] == 3.0, s
