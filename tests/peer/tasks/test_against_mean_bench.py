"""``bench/train.py --against-mean``: the honest cost of a run's averaging defaults, run
small (two peers, two epochs, two seeds) so that its table and verdicts are checked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import scaled


@pytest.mark.slow
def test_bench_train_compares_the_run_defaults_with_the_mean() -> None:
    bench = Path(__file__).resolve().parents[3] / "bench" / "train.py"
    small = ["--task", "digits", "--peers", "2", "--epochs", "2", "--against-mean", "2"]
    done = subprocess.run(
        [sys.executable, str(bench), *small],
        capture_output=True,
        text=True,
        timeout=scaled(400),
    )
    assert done.returncode in (0, 1), done.stderr
    assert "aggregator=centered_clip relative_weight_bound=16.0" in done.stdout, done.stdout
    rows = re.findall(r"^\s+(\d) +([\d.]+) +([\d.]+) +([\d.]+)$", done.stdout, re.M)
    assert [seed for seed, *_ in rows] == ["0", "1"], done.stdout
    for _, defaults, mean, ratio in rows:
        assert 0 < float(defaults) <= 1 and 0 < float(mean) <= 1 and float(ratio) > 0
    verdict = re.search(r"difference [+-][\d.]+: (.*)$", done.stdout, re.M)
    assert verdict is not None, done.stdout
    assert (done.returncode == 1) == verdict.group(1).startswith("WORSE")
    assert re.search(r"samples/s with the defaults / with the mean: [\d.]+ \(pairs", done.stdout)
    refused = subprocess.run(
        [sys.executable, str(bench), *small, "--config", "aggregator=mean"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert refused.returncode != 0 and "sets aggregator" in refused.stderr
    assert "Traceback" not in refused.stderr
