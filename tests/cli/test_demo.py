"""``swarmgrad demo`` end to end, and the promise that it never leaves a process behind: not
when it ends, not on Ctrl-C, not when it is SIGKILLed itself.

Every process the demo starts inherits a marker in its environment; after the demo, a scan of
``/proc/*/environ`` must find none of them alive."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer.testing import wait_until
from tests.cli.conftest import child_env
from tests.conftest import scaled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc"),
]

MARKER_VARIABLE = "SWARMGRAD_TEST_DEMO_MARKER"


def marked_processes(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``marker``."""
    needle = f"{MARKER_VARIABLE}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone, or not ours
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


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
        code = self.process.wait(timeout)
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


def test_demo_trains_to_the_end_and_leaves_nothing_behind(demos: list[Demo]) -> None:
    demo = Demo("--peers", "2", "--epochs", "3")
    demos.append(demo)
    assert wait_until(lambda: len(marked_processes(demo.marker)) >= 4, scaled(60)), (
        "the demo, its coordinator and two volunteers run",
        demo.output(),
    )
    assert demo.wait(scaled(600)) == 0, demo.output()
    out = demo.output()
    assert re.search(r"^coordinator: http://127\.0\.0\.1:\d+", out, re.M), out
    epochs = [int(m.group(1)) for m in re.finditer(r"^epoch (\d+) \|", out, re.M)]
    assert epochs and max(epochs) >= 3 and epochs == sorted(epochs), out
    assert "the checkpoint of epoch 3" in out, out
    assert "Traceback" not in out and demo.errors == [], out
    assert marked_processes(demo.marker) == [], out


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
