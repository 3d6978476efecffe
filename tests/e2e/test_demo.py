"""``swarmgrad demo`` (what ``make demo`` runs): a coordinator and four volunteers train digits
for the task's 40 epochs; the run's progress moves within two minutes, the samples/s it shows
is within 20 % of its samples counter's growth over the span it is counted over, the
checkpoint it ends with reaches the task's target accuracy, and when it ends no process it
started is left behind."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from peer.formats.rates import RATE_WINDOW_S
from peer.tasks.base import TrainingConfig
from peer.tasks.registry import load_task
from server.config import Settings
from tests.conftest import scaled
from tests.e2e.demos import run_demo
from tests.peer.tasks.test_digits_task import TARGET_ACCURACY

pytestmark = pytest.mark.slow


# The span the coordinator counts a run's rate over, on average: from a progress snapshot at
# least RATE_WINDOW_S old, snapshots being taken every snapshot_interval_s.
_COUNTED_OVER_S = RATE_WINDOW_S + Settings.model_fields["snapshot_interval_s"].default / 2


def _trailing_growth(seen: list[dict[str, Any]], p: dict[str, Any]) -> float | None:
    """How fast the samples counter the watcher read grew over the span before ``p`` that the
    coordinator counts its rate over (None before the watcher has read that far back)."""
    before = [q for q in seen if q["t"] <= p["t"] - _COUNTED_OVER_S]
    if not before:
        return None
    q = before[-1]
    return (p["samples"] - q["samples"]) / (p["t"] - q["t"])


def _check_rates(seen: list[dict[str, Any]], output: str, epochs: int) -> None:
    """The samples/s the run shows (progress API, the demo's epoch lines) is within 20 % of
    how fast its samples counter grew over the span before each reading that the rate is
    counted over, in the middle half of the training. (A trailing rate lags a change of
    pace, as on a loaded machine: it is held against the growth over its own span, not
    over the whole middle half.)"""
    training = [p for p in seen if p["samples"] > 0 and p["peers_online"] and p["epoch"] < epochs]
    middle = training[len(training) // 4 : 3 * len(training) // 4 + 1]
    pairs = [
        (p["samples_per_second"], g) for p in middle if (g := _trailing_growth(seen, p)) is not None
    ]
    rates = [(round(p["t"]), p["samples"], round(p["samples_per_second"])) for p in training]
    assert len(pairs) >= 5, rates
    shown = statistics.mean(s for s, _ in pairs)
    growth = statistics.mean(g for _, g in pairs)
    assert shown == pytest.approx(growth, rel=0.2), rates
    printed = [
        float(m.group(1).replace(",", ""))
        for m in re.finditer(r"^epoch \d+ \| samples [\d,]+ \| ([\d,.]+) samples/s", output, re.M)
    ]
    lines = printed[len(printed) // 4 : 3 * len(printed) // 4 + 1]
    grown = statistics.median(g for _, g in pairs)
    assert lines and statistics.median(lines) == pytest.approx(grown, rel=0.2), (printed, rates)


def test_demo_trains_digits_with_four_volunteers(tmp_path: Path) -> None:
    saved = tmp_path / "model.pt"
    epochs = load_task("digits").defaults["epochs"]  # the demo's own: no --epochs
    demo = run_demo("--peers", "4", "--save", str(saved), timeout=600)
    output, port = demo.output, demo.port
    assert re.search(rf"^coordinator: http://127\.0\.0\.1:{port}", output, re.M), output
    assert re.search(rf"^dashboard: http://127\.0\.0\.1:{port}/runs/\w+", output, re.M), output
    shown = [int(m.group(1)) for m in re.finditer(r"^epoch (\d+) \|", output, re.M)]
    assert shown == sorted(shown) and shown[-1] >= epochs, output
    assert f"the checkpoint of epoch {epochs}" in output, output

    early = [p for p in demo.seen if p["t"] <= scaled(120)]
    assert early, output
    assert max(p["epoch"] for p in early) >= 3, [p["epoch"] for p in early]
    samples = [p["samples"] for p in early]
    assert samples[-1] > samples[0], samples
    assert any(g > 1 for p in early for g in p["recent_group_sizes"]), "peers averaged together"
    losses = [p["loss"] for p in demo.seen if p.get("loss") is not None]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses

    _check_rates(demo.seen, output, epochs)

    assert saved.exists(), output
    task = load_task("digits")
    config = TrainingConfig.from_run_config(task, {"epochs": epochs})
    model = task.build_model(config)
    model.load_state_dict(torch.load(saved)["model"])  # plain torch.load: the run's output
    model.eval()
    assert task.evaluate(model, config) >= TARGET_ACCURACY
