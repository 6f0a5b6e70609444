"""A bounded chaos round: see chaos.py (the soak is ``python python/tests/chaos.py``)."""

from __future__ import annotations

import chaos


def test_chaos_round(tmp_path):
    summary = chaos.run(duration=12, seed=20261122, workdir=tmp_path)
    # Enough happened for the checks to mean something.
    assert summary["actions"] >= 5 and summary["successes"] >= 100 and summary["errors"] >= 1, summary
    assert summary["syncs"] >= 100 and summary["repaired"] >= 1, summary
