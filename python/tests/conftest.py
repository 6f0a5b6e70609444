"""Fixtures: a real master in the test process, and real peer processes running worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import shoal

WORKER = Path(__file__).with_name("worker.py")


@pytest.fixture
def master() -> Iterator[shoal.Master]:
    with shoal.Master("127.0.0.1:0", heartbeat_timeout=10.0) as m:
        yield m


def run_peers(master: shoal.Master, tmp_path: Path, scenario: str, peers: int, timeout: float = 90, **params) -> list[dict]:
    """Runs ``peers`` processes of ``worker.py SCENARIO`` against ``master``; returns each one's
    JSON result, in launch order. Fails the test with every worker's stderr if one fails."""
    procs = []
    for i in range(peers):
        spec = {"master": master.address, "index": i, "peers": peers, "out": str(tmp_path / f"peer{i}"), **params}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario, json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")},
            )
        )
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: a peer did not finish within {timeout} s")
        outputs.append((p.returncode, out, err))
    failed = [(i, rc, err) for i, (rc, _, err) in enumerate(outputs) if rc != 0]
    if failed:
        pytest.fail("\n".join(f"peer {i} exited {rc}:\n{err}" for i, rc, err in failed))
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in outputs]
