"""One data directory is one volunteer: while a ``swarmgrad join`` trains, a second one on
the same directory (the same key, so the same peer to the coordinator) is refused at once
with the reason and the fix, and the first trains on undisturbed."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmgrad.local import start_volunteer
from swarmlab.node_process import wait_until
from tests.cli.conftest import Coordinator, run_swarmgrad
from tests.conftest import scaled

pytestmark = pytest.mark.slow

EPOCH_LINE = re.compile(r"^epoch (\d+) \| samples (\d+)")


class Running:
    """A ``swarmgrad join --quiet`` process whose output is read line by line."""

    def __init__(self, url: str, token: str, data_dir: Path) -> None:
        self.process = start_volunteer(url, token, data_dir, "--quiet", "--device", "cpu")
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def samples(self) -> int:
        found = [int(m.group(2)) for line in self.lines if (m := EPOCH_LINE.match(line))]
        return max(found, default=0)

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(scaled(20))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def running() -> Iterator[list[Running]]:
    started: list[Running] = []
    yield started
    for volunteer in started:
        volunteer.stop()


def test_a_second_join_on_one_data_dir_is_refused_and_the_first_trains_on(
    coordinator: Coordinator, tmp_path: Path, running: list[Running]
) -> None:
    with coordinator.client() as client:  # no natural end: the test decides
        run = client.create_run(coordinator.admin_token, "r", "digits", {"epochs": 100_000})
        invite = client.create_invite(coordinator.admin_token, run.id, max_uses=5)
    data_dir = tmp_path / "volunteer"
    first = Running(coordinator.url, invite.token, data_dir)
    running.append(first)
    assert wait_until(lambda: first.samples > 0, scaled(120)), first.output()

    second = run_swarmgrad(
        "join", coordinator.url, "--token", invite.token, "--data-dir", str(data_dir),
        "--quiet", timeout=60,
    )  # fmt: skip
    line = second.assert_one_error_line(code=1)
    assert str(data_dir) in line and "--data-dir" in line, line
    assert f"process {first.process.pid}" in line, line

    # the first was not taken over: it goes on training, and its token still counts
    trained = first.samples
    assert wait_until(lambda: first.samples > trained, scaled(60)), first.output()
    assert first.process.poll() is None, first.output()
    assert "invite" not in first.output(), first.output()

    # a second volunteer on this machine: a directory of its own
    other = Running(coordinator.url, invite.token, tmp_path / "another")
    running.append(other)
    assert wait_until(lambda: other.samples > 0, scaled(120)), other.output()
