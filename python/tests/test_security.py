"""Run credentials: only a peer that proves the run's secret joins (docs/protocol.md, "Joining").

The secret never crosses the wire: the master challenges every connection with a fresh nonce and
the peer's Join carries a keyed hash of it (crates/proto/src/auth.rs; a replayed proof is refused
in crates/proto/src/master/tests.rs)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import shoal
from shoal import AuthenticationError

SECRET = "correct horse battery staple"


def all_reduce_together(comms: list[shoal.Communicator]) -> list[np.ndarray]:
    out = [np.full(4, i + 1, np.float32) for i in range(len(comms))]
    threads = [threading.Thread(target=c.all_reduce, args=(x,), kwargs={"op": "sum"}) for c, x in zip(comms, out)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_only_peers_with_the_secret_join_and_a_refusal_changes_nothing_else():
    with shoal.Master("127.0.0.1:0", secret=SECRET, heartbeat_timeout=2) as master:
        first = shoal.Communicator(master.address, secret=SECRET)
        first.connect(timeout=10)
        for wrong in ("correct horse", None):
            stranger = shoal.Communicator(master.address, secret=wrong, timeout=30)
            started = time.time()
            with pytest.raises(AuthenticationError, match="credentials"):
                stranger.connect()
            assert time.time() - started < 5, "a refusal must not wait for the bound"
            stranger.close()
        second = shoal.Communicator(master.address, secret=SECRET)
        joined = threading.Thread(target=second.connect, kwargs={"timeout": 10})
        joined.start()
        while first.peers_pending() is False:
            time.sleep(0.05)
        first.update_topology()
        joined.join(timeout=10)
        assert first.world_size == second.world_size == 2
        results = all_reduce_together([first, second])
        assert all((x == 3).all() for x in results)
        first.close()
        second.close()


def test_the_secret_comes_from_the_environment_and_an_empty_one_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="empty"):
        shoal.Master("127.0.0.1:0", secret="")
    monkeypatch.setenv("SHOAL_SECRET", SECRET)
    with shoal.Master("127.0.0.1:0") as master:
        with shoal.Communicator(master.address) as comm:
            comm.connect(timeout=10)
        monkeypatch.delenv("SHOAL_SECRET")
        with shoal.Communicator(master.address) as comm, pytest.raises(AuthenticationError):
            comm.connect(timeout=10)


def test_master_command_reads_the_secret_from_a_file(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "master", "--listen", "127.0.0.1:0", "--secret-file",
                             str(secret_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        address = proc.stdout.readline().split()[-1]
        with shoal.Communicator(address, secret=SECRET) as comm:
            comm.connect(timeout=10)
        with shoal.Communicator(address, secret="guess") as comm, pytest.raises(AuthenticationError):
            comm.connect(timeout=10)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "authentication failed" in err, err
