"""The custom task of the user guide (docs/volunteers.md) loads by name and learns."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from peer.tasks.base import TrainingConfig
from peer.tasks.registry import load_task
from swarmlab.simulate import simulate_swarm

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "volunteers.md"


def test_the_guides_custom_task_loads_by_name_and_learns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = GUIDE.read_text().split("# mytasks.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "mytasks.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mytasks", raising=False)
    task = load_task("mytasks:sine")
    config = TrainingConfig.from_run_config(task, {"width": 16})
    assert config.params["width"] == 16
    before = task.evaluate(task.build_model(config), config)
    trained = simulate_swarm(task, config, epochs=30, peers=2).model
    assert task.evaluate(trained, config) < before / 2
