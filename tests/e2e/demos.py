"""``swarmgrad demo`` run to its end in a child process, its coordinator's progress read
once a second meanwhile: what the end-to-end tests check a whole run with."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from swarmgrad.local import child_environment, free_port, stop_process
from tests.conftest import MARKER_VARIABLE, marked_processes, scaled


class ProgressWatcher:
    """Reads every run's progress from the demo's coordinator once a second, in a thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[dict[str, Any]] = []  # progress answers, with "t": seconds since start
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while not self._stop.wait(1.0):
                try:
                    runs = client.get("/api/v1/runs").json()["runs"]
                    if runs:
                        progress = client.get(f"/api/v1/runs/{runs[0]['id']}/progress").json()
                        progress["t"] = time.monotonic() - self._started
                        self.seen.append(progress)
                except (httpx.HTTPError, KeyError, ValueError):
                    continue  # not up yet, or already gone

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class DemoRun:
    port: int
    output: str  # stdout and stderr, interleaved
    seen: list[dict[str, Any]]  # the progress answers read while it ran


def run_demo(*args: str, timeout: float) -> DemoRun:
    """``swarmgrad demo ARGS --port P`` to its end (``timeout`` scaled). It must exit 0
    without a traceback and leave no process it started behind."""
    port = free_port()
    marker = uuid.uuid4().hex
    process = subprocess.Popen(
        [sys.executable, "-m", "swarmgrad", "demo", *args, "--port", str(port)],
        env=child_environment({MARKER_VARIABLE: marker}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watcher = ProgressWatcher(f"http://127.0.0.1:{port}")
    try:
        output, _ = process.communicate(timeout=scaled(timeout))
    finally:
        watcher.close()
        if process.poll() is None:
            stop_process(process)
    assert process.returncode == 0, output
    assert "Traceback" not in output, output
    assert marked_processes(marker) == [], "every process the demo started is gone"
    return DemoRun(port, output, watcher.seen)
