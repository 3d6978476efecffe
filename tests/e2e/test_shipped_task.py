"""A task that travels with its run: the organizer ships a task file and a requirement with
``swarmgrad runs create --task-file``, and three ``swarmgrad join --trust-task`` volunteers,
none of which has the task or its requirement installed, train it to the run's end. pip
installs the requirement offline from a wheel built here, into each volunteer's own task
directory."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from peer.coordinator import CoordinatorClient
from swarmgrad.local import (
    LocalCoordinator,
    child_environment,
    start_volunteer,
    stop_processes,
)
from tests.conftest import scaled
from tests.peer.tasks.wheels import build_wheel

pytestmark = pytest.mark.slow

HELPER = "swarm_e2e_helper"
TASK_FILE = f"""\
from types import MappingProxyType

from peer.tasks.digits import DigitsTask
from {HELPER} import HIDDEN


class ShippedDigits(DigitsTask):
    name = "shipped_digits"
    defaults = MappingProxyType({{**DigitsTask.defaults, "hidden": HIDDEN}})


def make():
    return ShippedDigits()
"""
EPOCHS = 3


def organizer(coordinator: LocalCoordinator, *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "swarmgrad", *args, "--json"],
        env=child_environment(
            {"SWARMGRAD_URL": coordinator.url, "SWARMGRAD_TOKEN": coordinator.admin_token}
        ),
        capture_output=True,
        text=True,
        timeout=scaled(60),
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_three_volunteers_train_a_task_none_of_them_had(tmp_path: Path) -> None:
    assert importlib.util.find_spec(HELPER) is None  # not in this environment
    wheels = tmp_path / "wheels"
    build_wheel(wheels, HELPER, "HIDDEN = 12\n")
    task_path = tmp_path / "organizer" / "shipped_digits.py"
    task_path.parent.mkdir()
    task_path.write_text(TASK_FILE)
    digest = hashlib.sha256(TASK_FILE.encode()).hexdigest()
    env = {"SWARMGRAD_REPORT_INTERVAL_S": "1"}
    with LocalCoordinator(tmp_path / "coordinator", env=env) as coordinator:
        run = organizer(
            coordinator,
            *("runs", "create", "shipped", "--task-file", f"{task_path}:make"),
            *("--requirement", HELPER, "--no-check", "--min-volunteers", "3"),
            *("--config", f"epochs={EPOCHS}", "--config", "matchmaking_time=0.5"),
        )
        assert run["task_file"]["sha256"] == digest
        invite = organizer(coordinator, "invite", run["id"], "--uses", "3")["token"]
        offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
        data_dirs = [tmp_path / f"volunteer-{i}" for i in range(3)]
        logs = [(tmp_path / f"volunteer-{i}.log").open("w") for i in range(3)]
        processes = [
            start_volunteer(
                coordinator.url,
                invite,
                data_dir,
                *("--quiet", "--trust-task", "--host", "127.0.0.1"),
                stdout=log,
                env={**offline, "OMP_NUM_THREADS": "1"},
            )
            for data_dir, log in zip(data_dirs, logs, strict=True)
        ]
        try:
            # the run finishes by itself at its last epoch; the volunteers then leave
            codes = [p.wait(scaled(300)) for p in processes]
        finally:
            stop_processes(processes)
            for log in logs:
                log.close()
        outputs = [(tmp_path / f"volunteer-{i}.log").read_text() for i in range(3)]
        assert codes == [0, 0, 0], outputs
        with CoordinatorClient(coordinator.url) as client:
            assert client.run(run["id"]).status.value == "finished"
            found = client.download_checkpoint(coordinator.admin_token, run["id"])
    assert found is not None and found[1] == EPOCHS, outputs
    state = torch.load(io.BytesIO(found[0]), weights_only=True)
    # the helper's width, which only the shipped requirement knew: the model was the task's
    assert {tuple(t.shape) for t in state["model"].values()} >= {(12, 64), (10, 12)}
    for data_dir in data_dirs:
        task_dir = data_dir / "tasks" / digest
        assert (task_dir / "shipped_digits.py").read_text() == TASK_FILE
        assert (task_dir / "site" / HELPER / "__init__.py").exists()
    assert importlib.util.find_spec(HELPER) is None
