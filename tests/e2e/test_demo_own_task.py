"""``swarmgrad demo`` trains a task of the user's own: ``--task-file FILE[:function]`` or
``--task module:function``, imported the same way by the demo and its volunteers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.cli.conftest import run_swarmgrad
from tests.e2e.demos import run_demo

TASK_FILE = """\
from types import MappingProxyType

from peer.tasks.digits import DigitsTask


class SmallDigits(DigitsTask):
    name = "small_digits"
    defaults = MappingProxyType({**DigitsTask.defaults, "hidden": 16})


def make():
    return SmallDigits()
"""


@pytest.mark.slow
def test_a_task_file_trains_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "my_digits.py").write_text(TASK_FILE)
    task_file = f"{tmp_path / 'my_digits.py'}:make"
    finals = tmp_path / "volunteers"
    demo = run_demo(
        *("--task-file", task_file, "--peers", "2", "--epochs", "3"),
        *("--save-volunteers", str(finals)),
        timeout=300,
    )
    assert re.search(r"^run demo-my_digits:make \(\w+\): 2 volunteer", demo.output, re.M)
    assert "the checkpoint of epoch 3" in demo.output, demo.output
    assert any(p["epoch"] >= 1 for p in demo.seen), demo.output
    # each volunteer's own final model, of the task's width (whether the two agree is for
    # tests/e2e/test_examples.py: under load a peer that missed a round ends apart)
    states = [torch.load(finals / f"peer-{i}.pt", weights_only=True) for i in range(2)]
    assert {s["task"] for s in states} == {"small_digits"}
    assert max(s["epoch"] for s in states) == 3, demo.output
    assert {tuple(s["model"]["0.weight"].shape) for s in states} == {(16, 64)}


def test_a_task_that_cannot_load_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("def task():\n    return 42\n")
    line = run_swarmgrad("demo", "--task-file", str(tmp_path / "broken.py"))
    text = line.assert_one_error_line(code=2)
    assert "returned int, not a peer.tasks.Task" in text and "coordinator" not in line.out
    text = run_swarmgrad("demo", "--task-file", str(tmp_path / "absent.py"))
    assert "not a Python file" in text.assert_one_error_line(code=2)
    text = run_swarmgrad("demo", "--task", "no_such_module:task").assert_one_error_line(code=2)
    assert "No module named 'no_such_module'" in text
    both = run_swarmgrad("demo", "--task", "charlm", "--task-file", str(tmp_path / "broken.py"))
    assert "not both" in both.assert_one_error_line(code=2)
