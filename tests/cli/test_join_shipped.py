"""A run that ships its task file, from the command line: the organizer attaches it with
``runs create --task-file``; ``swarmgrad join`` refuses, with one line and nothing installed,
a file that does not match the run's digest, a file its owner did not consent to, and
requirements it cannot install."""

from __future__ import annotations

import hashlib
import io
import json
import os
import site
from pathlib import Path
from typing import Any

import pytest

from tests.cli.conftest import Coordinator, Result, child_env, run_swarmgrad

TASK = """\
from peer.tasks.digits import DigitsTask


def make():
    return DigitsTask()
"""


@pytest.fixture
def organizer(cli: Any, coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("SWARMGRAD_URL", coordinator.url)
    monkeypatch.setenv("SWARMGRAD_TOKEN", coordinator.admin_token)
    return cli


def ship(organizer: Any, tmp_path: Path, *requirements: str) -> dict[str, Any]:
    """A run shipping ``shipped_digits.py``, created with the organizer's command."""
    path = tmp_path / "shipped_digits.py"
    path.write_text(TASK)
    extra = [arg for r in requirements for arg in ("--requirement", r)]
    result = organizer(
        "runs", "create", "shipped", "--task-file", f"{path}:make", *extra, "--no-check", "--json"
    )
    assert result.code == 0, result.err
    run: dict[str, Any] = json.loads(result.out)
    return run


def invite(organizer: Any, run_id: str) -> str:
    result = organizer("invite", run_id, "--json")
    assert result.code == 0, result.err
    token: str = json.loads(result.out)["token"]
    return token


def join(coordinator: Coordinator, token: str, data_dir: Path, *args: str, **env: str) -> Result:
    return run_swarmgrad(
        "join", coordinator.url, "--token", token, "--data-dir", str(data_dir), "--quiet", *args,
        env=child_env(**env),
    )  # fmt: skip


def environment() -> set[str]:
    return {name for d in site.getsitepackages() for name in os.listdir(d)}


def test_the_organizer_ships_a_task_file_with_its_digest(organizer: Any, tmp_path: Path) -> None:
    run = ship(organizer, tmp_path, "numpy>=1.26")
    assert run["task"] == "shipped_digits:make"
    assert run["task_file"] == {
        "filename": "shipped_digits.py",
        "sha256": hashlib.sha256(TASK.encode()).hexdigest(),
        "size": len(TASK.encode()),
        "requirements": ["numpy>=1.26"],
    }
    shown = organizer("runs", "show", run["id"])
    assert "task sha256" in shown.out and "shipped_digits.py" in shown.out
    refused = organizer("runs", "create", "x", "--task-file", str(tmp_path / "absent.py"))
    assert "not a Python file" in refused.err
    bad = organizer(
        "runs", "create", "x", "--task-file", str(tmp_path / "shipped_digits.py:make"),
        "--requirement", "--index-url=http://elsewhere", "--no-check",
    )  # fmt: skip
    assert bad.code == 2 and "no pip options" in bad.err
    assert "--task" in organizer("runs", "create", "x").err


def test_join_without_consent_and_without_a_terminal_is_refused(
    organizer: Any, coordinator: Coordinator, tmp_path: Path
) -> None:
    run = ship(organizer, tmp_path)
    data_dir = tmp_path / "volunteer"
    line = join(coordinator, invite(organizer, run["id"]), data_dir).assert_one_error_line(code=1)
    assert "--trust-task" in line and run["task_file"]["sha256"] in line
    assert not (data_dir / "tasks").exists()
    other = join(
        coordinator, invite(organizer, run["id"]), data_dir, "--task-sha256", "ab" * 32
    ).assert_one_error_line(code=1)
    assert "you consented to" in other and not (data_dir / "tasks").exists()


def test_join_refuses_a_file_that_does_not_match_the_runs_digest(
    organizer: Any, coordinator: Coordinator, tmp_path: Path
) -> None:
    from sqlalchemy import create_engine, update

    from server.models import TaskFile

    run = ship(organizer, tmp_path)
    engine = create_engine(coordinator.database_url)
    try:  # the coordinator's copy altered behind its back
        with engine.begin() as connection:
            connection.execute(update(TaskFile).values(content=b"import os\nos.system('x')\n"))
    finally:
        engine.dispose()
    data_dir = tmp_path / "volunteer"
    result = join(coordinator, invite(organizer, run["id"]), data_dir, "--trust-task")
    line = result.assert_one_error_line(code=1)
    assert "does not match the run's digest" in line and "nothing was installed" in line
    assert not (data_dir / "tasks").exists()


def test_join_refuses_requirements_it_cannot_install_and_installs_nothing(
    organizer: Any, coordinator: Coordinator, tmp_path: Path
) -> None:
    run = ship(organizer, tmp_path, "swarmgrad-no-such-package-x")
    data_dir = tmp_path / "volunteer"
    before = environment()
    result = join(
        coordinator, invite(organizer, run["id"]), data_dir, "--trust-task", PIP_NO_INDEX="1"
    )
    line = result.assert_one_error_line(code=1)
    assert "cannot install the task's requirements (swarmgrad-no-such-package-x)" in line
    assert list((data_dir / "tasks").iterdir()) == []
    assert environment() == before


def test_a_person_at_the_terminal_is_asked_and_no_is_the_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from swarmgrad.join import LineDisplay

    what = "task t:make from t.py (sha256 ab, 10 bytes; requirements: none)"
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    assert LineDisplay(io.StringIO()).ask(what) is True
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert LineDisplay(io.StringIO()).ask(what) is False
    asked = capsys.readouterr().err
    assert what in asked and "organizer's code" in asked and "Run it? [y/N]" in asked
