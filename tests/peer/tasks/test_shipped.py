"""A task file shipped with a run, on the volunteer's side (peer.tasks.shipped): the bytes are
checked against the run's digest, the owner's consent is needed, requirements go into a
directory of the task's own (pip, offline here: a wheel built by hand) or nothing is left
at all; each refusal is one line, before anything is imported or installed."""

from __future__ import annotations

import hashlib
import os
import site
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from peer.formats.payloads import TaskFilePublic
from peer.formats.task_files import MAX_TASK_FILE_BYTES
from peer.tasks.base import Task, TaskError
from peer.tasks.shipped import (
    Consent,
    TaskRefused,
    import_task_file,
    load_run_task,
    parse_task_file,
    task_file_body,
)
from tests.peer.tasks.wheels import build_wheel

MODULE = "shipped_digits_task"
HELPER = "swarm_shipped_helper"  # installed only into the task's own directory
TASK = """\
from types import MappingProxyType

from peer.tasks.digits import DigitsTask
{imports}


class ShippedDigits(DigitsTask):
    name = "shipped_digits"
    defaults = MappingProxyType({{**DigitsTask.defaults, "hidden": {hidden}}})


def make():
    return ShippedDigits()
"""
PLAIN = TASK.format(imports="", hidden=8).encode()
NEEDS_HELPER = TASK.format(imports=f"from {HELPER} import HIDDEN", hidden="HIDDEN").encode()


@dataclass
class RunDescription:
    task: str
    task_file: TaskFilePublic | None


@dataclass
class FakeCoordinator:
    """What load_run_task asks of a coordinator: the run's description and its file."""

    data: bytes
    requirements: list[str] = field(default_factory=list)
    digest: str | None = None  # what the run names; the file's own by default
    host: str = "coordinator.test"
    downloads: int = 0

    def run(self, run_id: str) -> RunDescription:
        digest = self.digest or hashlib.sha256(self.data).hexdigest()
        shipped = TaskFilePublic(
            filename=f"{MODULE}.py",
            sha256=digest,
            size=len(self.data),
            requirements=self.requirements,
        )
        return RunDescription(f"{MODULE}:make", shipped)

    def download_task(self, token: str, run_id: str) -> bytes:
        self.downloads += 1
        return self.data


@pytest.fixture(autouse=True)
def fresh_module() -> Iterator[None]:
    """The task's module and its directories leave sys.modules and sys.path after a test."""
    path = list(sys.path)
    yield
    for name in (MODULE, HELPER):
        sys.modules.pop(name, None)
    sys.path[:] = path


@pytest.fixture
def offline_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip without the network: only the wheels in the returned directory."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def environment() -> set[str]:
    """What the volunteer's own environment holds: its site-packages' entries."""
    return {name for d in site.getsitepackages() for name in os.listdir(d)}


def load(coordinator: FakeCoordinator, data_dir: Path, consent: Consent) -> Task:
    return load_run_task(coordinator, "sgj_token", "run1", data_dir, consent)  # type: ignore[arg-type]


def test_a_file_that_does_not_match_the_runs_digest_is_refused(tmp_path: Path) -> None:
    tampered = FakeCoordinator(PLAIN, digest=hashlib.sha256(b"the organizer's").hexdigest())
    with pytest.raises(TaskRefused) as refused:
        load(tampered, tmp_path, Consent(trusted=True))
    line = str(refused.value)
    assert "does not match the run's digest" in line and "\n" not in line
    assert "nothing was installed or run" in line
    assert not (tmp_path / "tasks").exists() and MODULE not in sys.modules


def test_a_file_over_the_bound_is_refused_before_its_digest_is_taken(tmp_path: Path) -> None:
    huge = FakeCoordinator(b"#" * (MAX_TASK_FILE_BYTES + 1))
    with pytest.raises(TaskRefused, match="over the 524,288 a run may ship"):
        load(huge, tmp_path, Consent(trusted=True))
    assert not (tmp_path / "tasks").exists()


def test_without_consent_nothing_runs_and_the_line_says_how_to_consent(tmp_path: Path) -> None:
    coordinator = FakeCoordinator(PLAIN, requirements=["numpy"])
    digest = hashlib.sha256(PLAIN).hexdigest()
    with pytest.raises(TaskRefused) as refused:
        load(coordinator, tmp_path, Consent())
    line = str(refused.value)
    assert "--trust-task" in line and f"--task-sha256 {digest}" in line and "\n" not in line
    assert f"{MODULE}.py" in line and "requirements: numpy" in line
    asked: list[str] = []
    with pytest.raises(TaskRefused, match="you declined"):
        load(coordinator, tmp_path, Consent(ask=lambda what: asked.append(what) is not None))
    assert asked and digest in asked[0]
    with pytest.raises(TaskRefused, match="you consented to"):
        load(coordinator, tmp_path, Consent(sha256="0" * 64))
    assert not (tmp_path / "tasks").exists() and MODULE not in sys.modules


def test_consent_by_digest_or_by_answer_loads_the_task(tmp_path: Path) -> None:
    coordinator = FakeCoordinator(PLAIN)
    digest = hashlib.sha256(PLAIN).hexdigest()
    task = load(coordinator, tmp_path, Consent(sha256=digest.upper()))
    assert task.name == "shipped_digits" and task.defaults["hidden"] == 8
    assert (tmp_path / "tasks" / digest / f"{MODULE}.py").read_bytes() == PLAIN
    sys.modules.pop(MODULE)
    assert load(coordinator, tmp_path, Consent(ask=lambda what: True)).name == "shipped_digits"


def test_a_requirement_that_cannot_be_installed_leaves_nothing_behind(
    tmp_path: Path, offline_pip: Path
) -> None:
    before = environment()
    coordinator = FakeCoordinator(NEEDS_HELPER, requirements=["swarmgrad-no-such-package-x"])
    with pytest.raises(TaskRefused) as refused:
        load(coordinator, tmp_path / "data", Consent(trusted=True))
    line = str(refused.value)
    assert line.startswith("cannot install the task's requirements (swarmgrad-no-such-package-x)")
    assert "swarmgrad-no-such-package-x" in line.partition(":")[2] and "\n" not in line
    assert list((tmp_path / "data" / "tasks").iterdir()) == []  # no staging left either
    assert environment() == before and MODULE not in sys.modules


def test_requirements_go_into_the_tasks_own_directory(tmp_path: Path, offline_pip: Path) -> None:
    build_wheel(offline_pip, HELPER, "HIDDEN = 12\n")
    before = environment()
    coordinator = FakeCoordinator(NEEDS_HELPER, requirements=[HELPER])
    task = load(coordinator, tmp_path, Consent(trusted=True))
    assert task.defaults["hidden"] == 12
    digest = hashlib.sha256(NEEDS_HELPER).hexdigest()
    helper = sys.modules[HELPER].__file__
    assert helper is not None
    assert Path(helper).is_relative_to(tmp_path / "tasks" / digest / "site")
    assert environment() == before
    # installed once: a second join reuses it, with no index to install from
    for wheel in offline_pip.iterdir():
        wheel.unlink()
    sys.modules.pop(MODULE)
    assert load(coordinator, tmp_path, Consent(trusted=True)).defaults["hidden"] == 12
    assert coordinator.downloads == 2


def test_the_organizers_file_and_its_body(tmp_path: Path) -> None:
    path = tmp_path / f"{MODULE}.py"
    path.write_bytes(PLAIN)
    local = parse_task_file(f"{path}:make")
    assert local.task == f"{MODULE}:make" and parse_task_file(str(path)).function == "task"
    body = task_file_body(local, ["numpy>=1.26"])
    assert body["filename"] == f"{MODULE}.py" and body["requirements"] == ["numpy>=1.26"]
    with pytest.raises(ValueError, match="no pip options"):
        task_file_body(local, ["-r requirements.txt"])
    with pytest.raises(ValueError, match="not a Python file"):
        parse_task_file(str(tmp_path / "absent.py"))
    (tmp_path / "my-task.py").write_text("")
    with pytest.raises(ValueError, match="identifiers"):
        parse_task_file(str(tmp_path / "my-task.py"))
    assert import_task_file(path, "make").name == "shipped_digits"
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / path.name).write_bytes(PLAIN)
    with pytest.raises(TaskError, match="already imported here from elsewhere"):
        import_task_file(other / path.name, "make")
