"""Task names → :class:`~peer.tasks.base.Task` objects.

A run names its task as one of the built-ins (:data:`BUILTIN`: ``"digits"``, ``"charlm"``)
or as ``"package.module:function"``: the module is imported and ``function()`` must return
a Task. Every failure — a module that does not import, a missing or uncallable attribute,
a factory that raises or returns something else — is a :class:`~peer.tasks.base.TaskError`
whose text is one line, e.g. ``cannot import task 'mytasks:make': No module named 'mytasks'``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from types import ModuleType

from peer.tasks.base import Task, TaskError

__all__ = ["BUILTIN", "load_task", "task_from_module"]

# name → "module:class"; the class is called with no arguments
BUILTIN: dict[str, str] = {
    "digits": "peer.tasks.digits:DigitsTask",
    "charlm": "peer.tasks.charlm:CharLMTask",
}

_SPEC = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<function>[A-Za-z_]\w*)")
_REQUIRED: dict[str, type] = {
    "name": str,
    "metric_name": str,
    "higher_is_better": bool,
    "defaults": Mapping,
}


def load_task(name: str) -> Task:
    """A new Task object for ``name``: a built-in or ``"package.module:function"``."""
    if not isinstance(name, str):
        raise TaskError(f"a task name is a string, not {type(name).__name__}")
    target = BUILTIN.get(name, name)
    match = _SPEC.fullmatch(target)
    if match is None:
        raise TaskError(
            f"unknown task {name!r}: use {', '.join(BUILTIN)} or package.module:function"
        )
    module_name, function_name = match["module"], match["function"]
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the module is someone else's code: any error means "cannot"
        raise TaskError(f"cannot import task {name!r}: {_one_line(exc)}") from exc
    return task_from_module(name, module, function_name)


def task_from_module(name: str, module: ModuleType, function_name: str) -> Task:
    """The Task ``module.function_name()`` returns, checked; ``name`` is what errors call
    it."""
    module_name = module.__name__
    try:
        factory = getattr(module, function_name)
    except AttributeError as exc:
        raise TaskError(
            f"cannot load task {name!r}: module {module_name!r} has no attribute {function_name!r}"
        ) from exc
    if not callable(factory):
        raise TaskError(f"cannot load task {name!r}: {function_name} is not callable")
    try:
        task = factory()
    except Exception as exc:
        raise TaskError(
            f"cannot load task {name!r}: {function_name}() failed: {_one_line(exc)}"
        ) from exc
    if not isinstance(task, Task):
        raise TaskError(
            f"cannot load task {name!r}: {function_name}() returned "
            f"{type(task).__name__}, not a peer.tasks.Task"
        )
    for attribute, kind in _REQUIRED.items():
        if not isinstance(getattr(task, attribute, None), kind):
            raise TaskError(f"cannot load task {name!r}: its {attribute} is not a {kind.__name__}")
    return task


def _one_line(exc: BaseException) -> str:
    """``exc`` as one line: ``ImportError``'s own text, otherwise ``Class: text``."""
    text = " ".join(str(exc).split())
    if isinstance(exc, ImportError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
