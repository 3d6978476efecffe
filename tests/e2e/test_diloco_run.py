"""A run with ``algorithm: diloco`` trains charlm through ``swarmgrad join`` volunteers and a
coordinator (``swarmgrad demo --algorithm diloco``): its progress shows outer rounds (the
run's epochs) and bytes sent per sample (the dashboard's figures:
tests/server/test_report_bytes.py)."""

from __future__ import annotations

import pytest

from tests.e2e.demos import run_demo

pytestmark = pytest.mark.slow

ROUNDS = 2


def test_a_diloco_run_trains_charlm_and_shows_outer_rounds_and_bytes() -> None:
    demo = run_demo(
        *("--task", "charlm", "--algorithm", "diloco", "--peers", "2", "--epochs", str(ROUNDS)),
        timeout=300,
    )
    output = demo.output
    assert "(DiLoCo: an epoch is an outer round)" in output, output

    seen = demo.seen
    assert seen, output
    assert max(p["epoch"] for p in seen) >= ROUNDS, [p["epoch"] for p in seen]
    rounds = [(p["epoch"], p["rounds_done"], p["rounds_failed"]) for p in seen]
    assert max(p["rounds_done"] for p in seen) >= ROUNDS, (rounds, output)
    claimed = [p["bytes_per_sample"] for p in seen if p.get("bytes_per_sample")]
    assert claimed, "the progress shows bytes per sample"
    # each outer round moves a pseudo-gradient of the model's 0.43 M parameters (fp32) among
    # two peers every 10 inner steps of 32 samples: kilobytes per sample, not bytes
    assert 1_000 < claimed[-1] < 1_000_000, claimed
    losses = [p["loss"] for p in seen if p.get("loss") is not None]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    assert "the checkpoint of epoch" in output, output
