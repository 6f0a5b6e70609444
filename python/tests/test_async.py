"""Collectives in flight at once: overlap, tags, all_reduce_many and its retry after a loss."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import clean_env, run_peers, worker_argv

import shoal

HEARTBEAT_TIMEOUT = 2.0


def test_collectives_overlap_each_other_and_the_callers_compute(master: shoal.Master, tmp_path: Path) -> None:
    results = run_peers(master, tmp_path, "overlap", 3, timeout=120)
    for r in results:
        assert r["reused"] and "tag 3" in r["reused"] and "in flight" in r["reused"], r
        assert r["many"] == 12
    # The same collectives carry the same numbers on every peer.
    assert len({tuple(r["sequences"]) for r in results}) == 1


def test_a_tag_reused_in_flight_is_refused_at_once_and_loses_nothing(master: shoal.Master) -> None:
    with shoal.Communicator(master.address) as comm:
        comm.connect(timeout=10)
        x = np.arange(10, dtype=np.float32)
        work = comm.all_reduce_async(x, op="sum", tag=5)
        with pytest.raises(shoal.UsageError, match="tag 5"):
            comm.all_reduce_async(np.ones(3, np.float32), op="sum", tag=5)
        info = work.wait(timeout=10)
        assert work.done() and info.world_size == 1
        assert (x == np.arange(10, dtype=np.float32)).all()
        # Ended: the tag is free again.
        comm.all_reduce_async(np.ones(3, np.float32), op="sum", tag=5).wait()


def test_all_reduce_many_retries_after_a_peer_is_killed(tmp_path: Path) -> None:
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT) as master:
        procs = []
        for i in range(3):
            spec = {"master": master.address, "index": i, "peers": 3, "heartbeat_timeout": HEARTBEAT_TIMEOUT}
            procs.append(subprocess.Popen(worker_argv("many_survive", spec), stdout=subprocess.PIPE, text=True,
                                          env=clean_env()))
            time.sleep(0.2)
        for p in procs:
            assert p.stdout is not None and "ready" in p.stdout.readline()
        time.sleep(0.3)
        procs[1].send_signal(signal.SIGKILL)
        for p in (procs[0], procs[2]):
            out, _ = p.communicate(timeout=90)
            assert p.returncode == 0, out
            worlds = json.loads(out.strip().splitlines()[-1])["worlds"]
            # Every batch returned whole, in one world; the run went on with two.
            assert worlds[-1] == 2 and set(worlds) <= {2, 3}, worlds
        procs[1].communicate(timeout=10)


def test_a_collective_waited_for_after_the_master_is_lost_is_restored_before_the_wait_returns() -> None:
    """Once out of the run, a wait used to return the loss at once while its collective still
    held the array: the data plane restored it a moment later, over what the caller had written
    since (into freed memory, for a Work dropped unwaited: a chaos peer kicked with collectives in
    flight died of a segfault)."""
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT) as master:
        a, b = (shoal.Communicator(master.address, heartbeat_timeout=0.3, timeout=20) for _ in range(2))
        with a, b:
            joined = threading.Thread(target=b.connect, kwargs={"timeout": 10, "min_world_size": 2})
            joined.start()
            a.connect(timeout=10, min_world_size=2)
            joined.join()
            xs = [np.arange(1 << 16, dtype=np.float32) for _ in range(4)]
            works = [a.all_reduce_async(x, op="sum", tag=1 + i) for i, x in enumerate(xs)]  # b never joins in
            master.stop()
            for work, x in zip(works, xs):
                with pytest.raises(shoal.MasterUnreachableError):
                    work.wait()
                assert (x == np.arange(1 << 16, dtype=np.float32)).all()
                x[:] = 7
            time.sleep(0.3)  # the progress thread, had it kept the collectives, would have ended them
            assert all((x == 7).all() for x in xs)
