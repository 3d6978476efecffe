"""``swarmgrad demo``'s promise that it never leaves a process behind on Ctrl-C or when it is
SIGKILLed itself (its normal end is checked in ``tests/e2e/test_demo.py``).

Every process the demo starts inherits a marker in its environment; after the demo, a scan of
``/proc/*/environ`` must find none of them alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmlab.node_process import wait_until
from tests.cli.conftest import child_env
from tests.conftest import MARKER_VARIABLE, marked_processes, scaled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc"),
]


class Demo:
    """``swarmgrad demo ...`` in a child process, its output read line by line."""

    def __init__(self, *args: str) -> None:
        self.marker = uuid.uuid4().hex
        env = child_env(**{MARKER_VARIABLE: self.marker})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "swarmgrad", "demo", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.process.stdout, self.lines)),
            threading.Thread(target=self._read, args=(self.process.stderr, self.errors)),
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _read(stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line.rstrip("\n"))

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the demo did not exit within {timeout:.0f} s:\n{self.output()}"
            ) from None
        for thread in self._threads:
            thread.join(scaled(10))
        return code

    def output(self) -> str:
        return "\n".join([*self.lines, "--- stderr ---", *self.errors])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in marked_processes(self.marker):  # never leak into the next test
            os.kill(pid, signal.SIGKILL)
        for thread in self._threads:
            thread.join(scaled(10))
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def demos() -> Iterator[list[Demo]]:
    started: list[Demo] = []
    yield started
    for demo in started:
        demo.close()


def test_ctrl_c_stops_every_process(demos: list[Demo]) -> None:
    demo = Demo("--peers", "2", "--epochs", "1000")
    demos.append(demo)
    assert wait_until(lambda: any(line.startswith("run ") for line in demo.lines), scaled(120)), (
        demo.output()
    )
    assert len(marked_processes(demo.marker)) >= 4, demo.output()
    demo.process.send_signal(signal.SIGINT)
    assert demo.wait(scaled(60)) == 130, demo.output()
    assert "Traceback" not in demo.output()
    assert marked_processes(demo.marker) == [], demo.output()


def test_a_killed_demo_takes_its_children_along(demos: list[Demo]) -> None:
    demo = Demo("--peers", "2", "--epochs", "1000")
    demos.append(demo)
    assert wait_until(lambda: any(line.startswith("run ") for line in demo.lines), scaled(120)), (
        demo.output()
    )
    demo.process.kill()  # no chance to clean up: the kernel's parent-death signal must
    demo.wait(scaled(30))
    assert wait_until(lambda: marked_processes(demo.marker) == [], scaled(30)), marked_processes(
        demo.marker
    )
