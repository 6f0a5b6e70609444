"""Fixtures: a real master in the test process, and real peer processes running worker.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Union

import pytest

import shoal

WORKER = Path(__file__).with_name("worker.py")


@pytest.fixture
def master() -> Iterator[shoal.Master]:
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=10.0) as m:
        yield m


def clean_env() -> dict[str, str]:
    """The environment without SHOAL_* settings, so that a developer's shell cannot skew a test."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}


def worker_argv(scenario: str, spec: dict) -> list[str]:
    return [sys.executable, str(WORKER), scenario, json.dumps(spec)]


def start_ready(scenario: str, specs: list[dict]) -> list[subprocess.Popen]:
    """Starts one ``worker.py SCENARIO`` per spec, a moment apart (so that they join in order), and
    returns once every one printed that it is ready."""
    procs = []
    for spec in specs:
        procs.append(subprocess.Popen(worker_argv(scenario, spec), stdout=subprocess.PIPE, text=True,
                                      env=clean_env()))
        time.sleep(0.2)
    for p in procs:
        assert p.stdout is not None and "ready" in p.stdout.readline(), "a peer did not join"
    return procs


def release(victim: subprocess.Popen, sig: int) -> None:
    """Ends a victim that got ``sig`` (woken first if it was frozen) and reaps it."""
    if sig == signal.SIGSTOP:
        victim.send_signal(signal.SIGCONT)
    victim.kill()
    victim.communicate(timeout=10)


def need_lab(toxiproxy: bool = False) -> None:
    """Skips the test where no lab can be built (not root, no namespaces, no iptables; with
    ``toxiproxy``, also where toxiproxy is not installed), naming why; under
    SHOAL_LAB_REQUIRED=1 (CI as root) fails it instead, so that the lab tests cannot silently
    stop running."""
    from shoal.lab import toxiproxy_binary, unavailable

    reason = unavailable()
    if not reason and toxiproxy and toxiproxy_binary() is None:
        reason = "toxiproxy is not installed: run scripts/lab-deps"
    if reason and os.environ.get("SHOAL_LAB_REQUIRED") == "1":
        pytest.fail(f"SHOAL_LAB_REQUIRED=1 but {reason}")
    if reason:
        pytest.skip(reason)


def run_peers(master: Union[shoal.Master, str], tmp_path: Path, scenario: str, peers: int, timeout: float = 90,
              launch: Callable[[int, list[str]], list[str]] = lambda i, argv: argv,
              expect_killed: frozenset = frozenset(), **params) -> list[dict]:
    """Runs ``peers`` processes of ``worker.py SCENARIO`` against ``master`` (or its address);
    ``launch(i, argv)`` may wrap peer i's command (to run it in a lab host). Returns each one's
    JSON result, in launch order (None for those of ``expect_killed``, which must end by SIGKILL). Fails
    the test with every worker's stderr if one fails."""
    address = master if isinstance(master, str) else master.address
    procs = []
    for i in range(peers):
        spec = {"master": address, "index": i, "peers": peers, "out": str(tmp_path / f"peer{i}"), **params}
        procs.append(subprocess.Popen(launch(i, worker_argv(scenario, spec)), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=clean_env()))
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: a peer did not finish within {timeout} s")
        outputs.append((p.returncode, out, err))
    expected = [-signal.SIGKILL if i in expect_killed else 0 for i in range(peers)]
    failed = [(i, rc, err) for i, (rc, _, err) in enumerate(outputs) if rc != expected[i]]
    if failed:
        pytest.fail("\n".join(f"peer {i} exited {rc}:\n{err}" for i, rc, err in failed))
    return [None if i in expect_killed else json.loads(out.strip().splitlines()[-1])
            for i, (_, out, _) in enumerate(outputs)]
