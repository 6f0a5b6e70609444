"""The packaged training example (``shoal demo --train``): an MLP on scikit-learn's digits,
trained by 4 peer processes with DiLoCo, ends at the held-out loss of the run without churn
although two peers are SIGKILLed from outside and two newcomers join mid-run."""

from __future__ import annotations

import pytest

# shoal[train] (torch and scikit-learn): scripts/env installs both, so this runs in CI.
pytest.importorskip("torch")
pytest.importorskip("sklearn")

from shoal.train import Run, run  # noqa: E402

OUTER = 60


def anchors_agree(r: Run) -> None:
    by_step: dict = {}
    for e in r.outer():
        by_step.setdefault(e["outer"], set()).add(e["hash"])
    assert sorted(by_step) == list(range(1, OUTER + 1))
    assert [s for s, hashes in by_step.items() if len(hashes) > 1] == [], "peers' anchors differ"


def test_training_with_kills_and_joins_ends_at_the_loss_of_the_run_without():
    clean = run(outer_steps=OUTER, churn=False, pause=0.0)
    churned = run(outer_steps=OUTER, churn=True, pause=0.0)
    anchors_agree(clean)
    anchors_agree(churned)
    assert {e["world"] for e in clean.outer()} == {4}
    # Two founders died, two newcomers took up the anchor mid-run and trained to the end.
    assert churned.killed == [3, 2] and churned.joined == [4, 5]
    late = {e["peer"]: e["outer"] for e in churned.events if e["event"] == "joined" and e["peer"] >= 4}
    assert set(late) == {4, 5} and all(0 < step < OUTER for step in late.values()), late
    assert {e["peer"] for e in churned.events if e["event"] == "done"} == {0, 1, 4, 5}
    assert min(e["world"] for e in churned.outer()) == 3 and churned.final["world"] == 4
    # The model learned, and churn cost it at most a quarter of the loss (measured: 0.150
    # without, 0.150-0.17 with).
    assert clean.final_loss() < 0.25 and clean.final["accuracy"] > 0.93, clean.final
    assert churned.final_loss() <= 1.25 * clean.final_loss(), (churned.final_loss(), clean.final_loss())
