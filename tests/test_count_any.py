"""tools/count_any.py counts a function when Any is in its signature, and only then."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]

SOURCE = """
import typing
from typing import Any

def plain(x: int) -> int: ...
def takes(x: dict[str, Any]) -> None: ...
def gives() -> "list[Any]": ...
async def spreads(*args: typing.Any, **kwargs: int) -> None: ...
def body_only(x: int) -> None:
    y: Any = x
class Holder:
    def method(self, *, key: Any = None) -> None:
        def nested(z: int) -> Any: ...
"""


def _tool() -> ModuleType:
    path = REPO_ROOT / "tools" / "count_any.py"
    spec = importlib.util.spec_from_file_location("count_any", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_counts_any_in_parameters_and_returns_only(tmp_path: Path) -> None:
    tool = _tool()
    source = tmp_path / "module.py"
    source.write_text(SOURCE)
    counted = sorted(f.name for f in tool.functions(source) if tool.signature_has_any(f))
    assert counted == ["gives", "method", "nested", "spreads", "takes"]


def test_a_quoted_annotation_without_any_is_not_counted() -> None:
    tool = _tool()
    function = ast.parse('def f(x: "dict[str, int]") -> "Anything": ...').body[0]
    assert isinstance(function, ast.FunctionDef)
    assert not tool.signature_has_any(function)
