"""load_task: the built-ins, "package.module:function", and one-line TaskErrors."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from peer.tasks import Task, TaskError, TrainingConfig, load_task
from peer.tasks.registry import BUILTIN

TOY = textwrap.dedent(
    """
    from peer.tasks.base import Task

    class Toy(Task):
        name = "custom"
        metric_name = "score"
        higher_is_better = True
        def build_model(self, config): ...
        def train_batches(self, config, peer_id): ...
        def loss(self, model, batch): ...
        def batch_size(self, batch): return 1
        def evaluate(self, model, config): return 1.0
    """
)


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Writes a module with the given source under a fresh name; returns the name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(source: str) -> str:
        name = f"tasks_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtins_load_without_their_data(name: str) -> None:
    task = load_task(name)
    assert isinstance(task, Task) and task.name == name
    assert isinstance(task.metric_name, str) and isinstance(task.higher_is_better, bool)
    TrainingConfig.from_run_config(task, {})  # their defaults are valid
    assert load_task(name) is not task  # a fresh object per call


def test_a_custom_task_from_package_module_function(module: Callable[[str], str]) -> None:
    name = module(TOY + "\ndef make():\n    return Toy()\n")
    task = load_task(f"{name}:make")
    assert type(task).__name__ == "Toy" and task.name == "custom"
    assert load_task(f"{name}:Toy").metric_name == "score"  # a class is a factory too


def _message(name: str) -> str:
    with pytest.raises(TaskError) as caught:
        load_task(name)
    text = str(caught.value)
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.mark.parametrize("name", ["nope", "", "a:b:c", "mod:", ":f", "my-mod:f", "a.:f", "m:f()"])
def test_a_name_that_is_neither_builtin_nor_a_spec(name: str) -> None:
    assert _message(name) == f"unknown task {name!r}: use digits, charlm or package.module:function"


def test_a_name_that_is_not_a_string() -> None:
    with pytest.raises(TaskError, match="a task name is a string, not int"):
        load_task(3)  # type: ignore[arg-type]


def test_a_module_that_does_not_exist() -> None:
    assert _message("no_such_module_xyz.sub:make") == (
        "cannot import task 'no_such_module_xyz.sub:make': No module named 'no_such_module_xyz'"
    )


def test_a_module_that_fails_while_importing(module: Callable[[str], str]) -> None:
    name = module("raise RuntimeError('no GPU\\n here')\n")
    assert _message(f"{name}:make") == (
        f"cannot import task '{name}:make': RuntimeError: no GPU here"
    )
    broken = module("def make(:\n")
    assert _message(f"{broken}:make").startswith(
        f"cannot import task '{broken}:make': SyntaxError: "
    )


def test_a_missing_attribute(module: Callable[[str], str]) -> None:
    name = module(TOY)
    assert _message(f"{name}:make") == (
        f"cannot load task '{name}:make': module '{name}' has no attribute 'make'"
    )


def test_an_attribute_that_is_not_callable(module: Callable[[str], str]) -> None:
    name = module("make = 3\n")
    assert _message(f"{name}:make") == f"cannot load task '{name}:make': make is not callable"


def test_a_factory_that_needs_arguments(module: Callable[[str], str]) -> None:
    name = module(TOY + "\ndef make(size):\n    return Toy()\n")
    text = _message(f"{name}:make")
    assert text.startswith(f"cannot load task '{name}:make': make() failed: TypeError: ")
    assert "size" in text


def test_a_factory_that_returns_something_else(module: Callable[[str], str]) -> None:
    name = module("def make():\n    return 'digits'\n")
    assert _message(f"{name}:make") == (
        f"cannot load task '{name}:make': make() returned str, not a peer.tasks.Task"
    )


def test_a_task_without_its_attributes(module: Callable[[str], str]) -> None:
    name = module(
        TOY.replace('    metric_name = "score"\n', "") + "\ndef make():\n    return Toy()\n"
    )
    assert _message(f"{name}:make") == (
        f"cannot load task '{name}:make': its metric_name is not a str"
    )


def test_the_cause_is_kept_for_the_log() -> None:
    with pytest.raises(TaskError) as caught:
        load_task("no_such_module_xyz:make")
    assert isinstance(caught.value.__cause__, ImportError)
