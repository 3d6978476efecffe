"""The volunteer flow in real processes: a coordinator process, the organizer's command line
and ``swarmgrad join`` processes, exactly as people run them."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarmgrad.local import LocalCoordinator, start_volunteer
from swarmlab.node_process import wait_until
from tests.conftest import scaled

pytestmark = pytest.mark.slow

# Short rounds, no natural end: the tests decide when a run finishes.
FAST = ["--config", "matchmaking_time=0.5", "--config", "epochs=100000"]
EPOCH_LINE = re.compile(r"\bepoch (\d+)\b.*\bsamples (\d+)\b")
# The tests' coordinator asks its volunteers for a report every second (as the demo's does),
# so that what the tests watch moves at their pace.
REPORT_INTERVAL_S = 1.0


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[LocalCoordinator]:
    # a progress snapshot every second: a chart's history at the tests' pace
    env = {
        "SWARMGRAD_SNAPSHOT_INTERVAL_S": "1",
        "SWARMGRAD_REPORT_INTERVAL_S": str(REPORT_INTERVAL_S),
    }
    with LocalCoordinator(tmp_path / "coordinator", env=env) as running:
        yield running


def organizer(coordinator: LocalCoordinator, *args: str) -> Any:
    """Run an organizer command with --json; its parsed output."""
    done = subprocess.run(
        [sys.executable, "-m", "swarmgrad", *args, "--json"],
        env={
            **_env(),
            "SWARMGRAD_URL": coordinator.url,
            "SWARMGRAD_TOKEN": coordinator.admin_token,
        },
        capture_output=True,
        text=True,
        timeout=scaled(60),
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def progress(coordinator: LocalCoordinator, run_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{coordinator.url}/api/v1/runs/{run_id}/progress", timeout=10)
    answer.raise_for_status()
    return answer.json()


class Volunteer:
    """A ``swarmgrad join --quiet`` process whose output is read line by line in a thread."""

    def __init__(
        self, coordinator: LocalCoordinator, token: str, data_dir: Path, *args: str
    ) -> None:
        import threading

        self.process = start_volunteer(coordinator.url, token, data_dir, "--quiet", *args)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def epoch(self) -> int:
        """The newest epoch the volunteer printed (-1 before its first line)."""
        found = [int(m.group(1)) for line in self.lines if (m := EPOCH_LINE.search(line))]
        return max(found, default=-1)

    @property
    def samples(self) -> int:
        found = [int(m.group(2)) for line in self.lines if (m := EPOCH_LINE.search(line))]
        return max(found, default=0)

    def output(self) -> str:
        return "\n".join(self.lines)

    def interrupt(self) -> None:
        """Ctrl-C, without waiting (see :meth:`stop`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.interrupt()
            try:
                self.process.wait(scaled(20))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def volunteers() -> Iterator[list[Volunteer]]:
    started: list[Volunteer] = []
    yield started
    for volunteer in started:  # every one leaves at once, as after a shared Ctrl-C
        volunteer.interrupt()
    for volunteer in started:
        volunteer.stop()


def new_run(coordinator: LocalCoordinator, *config: str, uses: int = 10) -> tuple[str, str]:
    run = organizer(coordinator, "runs", "create", "flow", "--task", "digits", *FAST, *config)
    invite = organizer(coordinator, "invite", run["id"], "--uses", str(uses))
    return run["id"], invite["token"]


def test_two_volunteers_train_and_obey_pause_resume_finish(
    coordinator: LocalCoordinator, tmp_path: Path, volunteers: list[Volunteer]
) -> None:
    run_id, token = new_run(coordinator)
    volunteers += [Volunteer(coordinator, token, tmp_path / f"v{i}") for i in range(2)]

    def training_together() -> bool:
        p = progress(coordinator, run_id)
        return p["peers_online"] == 2 and 2 in p["recent_group_sizes"] and p["samples"] > 0

    assert wait_until(training_together, scaled(120)), progress(coordinator, run_id)
    before = progress(coordinator, run_id)["samples"]
    assert wait_until(lambda: progress(coordinator, run_id)["samples"] > before, scaled(30))

    organizer(coordinator, "runs", "pause", run_id)
    # Flat for longer than a report interval: between two reports, samples stand still
    # whether the peers train or not.
    window = REPORT_INTERVAL_S + scaled(2)
    assert wait_until(lambda: _flat(coordinator, run_id, window), scaled(90)), (
        "samples stop growing once the peers see the pause"
    )
    assert _flat(coordinator, run_id, window), "and stay flat while paused"
    assert all(v.process.poll() is None for v in volunteers), "a pause is not an exit"

    paused_at = progress(coordinator, run_id)["samples"]
    organizer(coordinator, "runs", "resume", run_id)
    assert wait_until(lambda: progress(coordinator, run_id)["samples"] > paused_at, scaled(60)), (
        "training goes on after resume"
    )

    organizer(coordinator, "runs", "finish", run_id)
    for volunteer in volunteers:
        assert volunteer.process.wait(scaled(60)) == 0, volunteer.output()
        assert "finished" in volunteer.output()
        assert "Traceback" not in volunteer.output()


def test_a_run_waits_for_its_volunteers_then_starts_by_itself(
    coordinator: LocalCoordinator, tmp_path: Path, volunteers: list[Volunteer]
) -> None:
    run_id, token = new_run(coordinator, "--min-volunteers", "2")
    first = Volunteer(coordinator, token, tmp_path / "v0")
    volunteers.append(first)
    waiting = "the run is waiting for 2 volunteers (1 online)"
    assert wait_until(lambda: waiting in first.lines, scaled(90)), first.output()
    assert progress(coordinator, run_id)["samples"] == 0, "nobody trains alone"

    volunteers.append(Volunteer(coordinator, token, tmp_path / "v1"))
    assert wait_until(lambda: progress(coordinator, run_id)["samples"] > 0, scaled(120)), (
        first.output()
    )
    shown = organizer(coordinator, "runs", "show", run_id)["run"]
    assert shown["status"] == "running" and shown["status_detail"] is None


def _flat(coordinator: LocalCoordinator, run_id: str, window: float) -> bool:
    """True if the run's sample count does not move for ``window`` seconds."""
    first = progress(coordinator, run_id)["samples"]
    time.sleep(window)  # watching for change over a window, not waiting for an event
    return progress(coordinator, run_id)["samples"] == first


def test_peers_train_through_a_coordinator_outage_and_their_reports_catch_up(
    coordinator: LocalCoordinator, tmp_path: Path, volunteers: list[Volunteer]
) -> None:
    run_id, token = new_run(coordinator)
    volunteers += [Volunteer(coordinator, token, tmp_path / f"v{i}") for i in range(2)]
    assert wait_until(lambda: progress(coordinator, run_id)["peers_online"] == 2, scaled(120)), (
        progress(coordinator, run_id)
    )
    assert wait_until(lambda: all(v.epoch >= 2 for v in volunteers), scaled(120))

    coordinator.kill()  # SIGKILL: nothing flushed, nothing said goodbye
    killed_at = time.time()
    epochs_at_kill = [v.epoch for v in volunteers]
    # the outage lasts three epochs: their reports wait in the volunteers until it ends
    assert wait_until(
        lambda: all(v.epoch > e + 2 for v, e in zip(volunteers, epochs_at_kill, strict=True)),
        scaled(60),
    ), "the swarm trains on while the coordinator is down"
    assert all(v.process.poll() is None for v in volunteers), "no peer crashed"
    processed = sum(v.samples for v in volunteers)

    coordinator.start()  # same port, same database; returns once it answers
    back_at = time.time()
    assert wait_until(lambda: progress(coordinator, run_id)["samples"] >= processed, scaled(60)), (
        progress(coordinator, run_id)["samples"],
        processed,
    )
    assert progress(coordinator, run_id)["epoch"] >= max(epochs_at_kill) + 2

    # The chart's history has no hole but the outage itself, and never goes back.
    def history() -> list[dict[str, Any]]:
        return list(progress(coordinator, run_id)["history"])

    def at(point: dict[str, Any]) -> float:
        return datetime.fromisoformat(point["t"]).timestamp()

    assert wait_until(lambda: at(history()[-1]) > back_at + 1, scaled(30))
    points = history()
    times = [at(p) for p in points]
    assert times[0] < killed_at, "points from before the outage are kept"
    # Peers retry with a back-off that doubles (±20 %) while the coordinator is away, so
    # their reports resume up to about the outage's length again after it answers; beyond
    # that, a report interval and a snapshot interval on each side.
    outage = back_at - killed_at
    longest = max(b - a for a, b in itertools.pairwise(times))
    assert longest <= 2.5 * outage + 2 * REPORT_INTERVAL_S + scaled(5), (longest, outage, points)
    samples = [p["samples"] for p in points]
    assert samples == sorted(samples), samples


def test_a_newcomer_after_every_peer_died_starts_from_the_newest_checkpoint(
    coordinator: LocalCoordinator, tmp_path: Path, volunteers: list[Volunteer]
) -> None:
    run_id, token = new_run(coordinator, "--config", "checkpoint_every=3")

    def checkpoint_epoch() -> int:
        checkpoint = progress(coordinator, run_id).get("checkpoint")
        return int(checkpoint["epoch"]) if checkpoint else -1

    volunteers += [Volunteer(coordinator, token, tmp_path / f"v{i}") for i in range(2)]
    assert wait_until(lambda: checkpoint_epoch() >= 6, scaled(180)), progress(coordinator, run_id)
    for volunteer in volunteers:
        volunteer.process.kill()
        volunteer.process.wait()
    saved = checkpoint_epoch()

    newcomer = Volunteer(coordinator, token, tmp_path / "newcomer")
    volunteers.append(newcomer)
    assert wait_until(lambda: newcomer.epoch >= 0, scaled(120)), newcomer.output()
    assert f"checkpoint at epoch {saved}" in newcomer.output(), newcomer.output()
    first = next(int(m.group(1)) for line in newcomer.lines if (m := EPOCH_LINE.search(line)))
    assert first >= saved, newcomer.output()


def test_an_unreachable_volunteer_says_so_names_its_ports_and_still_trains(
    coordinator: LocalCoordinator, tmp_path: Path, volunteers: list[Volunteer]
) -> None:
    """The coordinator dials a volunteer back at the address its request came from
    (127.0.0.1); one listening on 127.0.0.2 only cannot be reached there. It says so, names
    the ports a forward would open, and averages with the other by the links it dials (or
    punches) itself."""
    run_id, token = new_run(coordinator)
    volunteers.append(Volunteer(coordinator, token, tmp_path / "open"))
    hidden = Volunteer(coordinator, token, tmp_path / "hidden", "--host", "127.0.0.2")
    volunteers.append(hidden)
    assert wait_until(lambda: "behind a NAT" in hidden.output(), scaled(60)), hidden.output()
    assert re.search(r"forward TCP ports \d+ and \d+", hidden.output()), hidden.output()

    def averaging_together() -> bool:
        p = progress(coordinator, run_id)
        return p["peers_online"] == 2 and 2 in p["recent_group_sizes"]

    assert wait_until(averaging_together, scaled(120)), progress(coordinator, run_id)
    # The coordinator may record the shared round before the hidden volunteer's next status
    # line says so: wait for the line, not for a fixed moment.
    assert wait_until(lambda: hidden.epoch >= 1, scaled(60)), hidden.output()


def test_ctrl_c_leaves_the_swarm_cleanly_within_seconds(
    coordinator: LocalCoordinator, tmp_path: Path, volunteers: list[Volunteer]
) -> None:
    _, token = new_run(coordinator)
    leaving, staying = (Volunteer(coordinator, token, tmp_path / f"v{i}") for i in range(2))
    volunteers += [leaving, staying]
    assert wait_until(lambda: "| peers 2 |" in staying.output(), scaled(120)), staying.output()

    leaving.process.send_signal(signal.SIGINT)
    # A few seconds when the machine is idle; the bound leaves room for a loaded CI machine.
    assert leaving.process.wait(scaled(30)) == 0, leaving.output()
    assert "left the run" in leaving.output()
    # Its progress record was retracted, not left to expire (60 s): the other peer sees at
    # once that it is alone.
    assert wait_until(lambda: staying.lines and "| peers 1 |" in staying.lines[-1], scaled(15)), (
        staying.output()
    )
