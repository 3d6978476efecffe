"""A run with ``algorithm: diloco`` trains charlm through ``swarmgrad join`` volunteers and a
coordinator (``swarmgrad demo --algorithm diloco``): its progress shows outer rounds (the
run's epochs) and bytes sent per sample (the dashboard's figures:
tests/server/test_report_bytes.py)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from swarmgrad.local import child_environment, free_port, stop_process
from tests.conftest import MARKER_VARIABLE, marked_processes, scaled
from tests.e2e.test_demo import ProgressWatcher

pytestmark = pytest.mark.slow

ROUNDS = 2


def test_a_diloco_run_trains_charlm_and_shows_outer_rounds_and_bytes(tmp_path: Path) -> None:
    port = free_port()
    marker = uuid.uuid4().hex
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "swarmgrad", "demo", "--task", "charlm"),
            *("--algorithm", "diloco", "--peers", "2", "--epochs", str(ROUNDS)),
            *("--port", str(port)),
        ],
        env=child_environment({MARKER_VARIABLE: marker}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    watcher = ProgressWatcher(url)
    try:
        output, _ = process.communicate(timeout=scaled(300))
    finally:
        watcher.close()
        if process.poll() is None:
            stop_process(process)
    assert process.returncode == 0, output
    assert "Traceback" not in output, output
    assert "(DiLoCo: an epoch is an outer round)" in output, output
    assert marked_processes(marker) == [], "every process the demo started is gone"

    seen = watcher.seen
    assert seen, output
    assert max(p["epoch"] for p in seen) >= ROUNDS, [p["epoch"] for p in seen]
    assert max(p["rounds_done"] for p in seen) >= ROUNDS, "the peers averaged outer rounds"
    claimed = [p["bytes_per_sample"] for p in seen if p.get("bytes_per_sample")]
    assert claimed, "the progress shows bytes per sample"
    # each outer round moves a pseudo-gradient of the model's 0.43 M parameters (fp32) among
    # two peers every 10 inner steps of 32 samples: kilobytes per sample, not bytes
    assert 1_000 < claimed[-1] < 1_000_000, claimed
    losses = [p["loss"] for p in seen if p.get("loss") is not None]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    assert "the checkpoint of epoch" in output, output
