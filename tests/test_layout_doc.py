"""docs/architecture.md's file tree is the package tree as tools/layout.py writes it: a module
moved, added or re-described without running the script fails here."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layout", REPO_ROOT / "tools" / "layout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_doc_holds_the_generated_tree() -> None:
    tool = _tool()
    document = (REPO_ROOT / "docs" / "architecture.md").read_text()
    expected = tool.rewritten(document, tool.tree(REPO_ROOT))
    difference = difflib.unified_diff(
        document.splitlines(), expected.splitlines(), "committed", "generated", lineterm="", n=1
    )
    assert expected == document, (
        "docs/architecture.md's tree differs from the package tree: run "
        "`.venv/bin/python tools/layout.py` and commit the doc\n" + "\n".join(list(difference)[:60])
    )


def test_a_new_module_changes_the_tree(tmp_path: Path) -> None:
    tool = _tool()
    for package in tool.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f'"""The {package} package."""\n')
    before = tool.tree(tmp_path)
    (tmp_path / "peer" / "added.py").write_text('"""A module, e.g. this one. More text."""\n')
    after = tool.tree(tmp_path)
    assert "added.py" not in before
    assert "  added.py              A module, e.g. this one.\n" in after


def test_a_doc_without_the_markers_is_refused() -> None:
    tool = _tool()
    with pytest.raises(ValueError, match="marker"):
        tool.rewritten("# Architecture\n", tool.BEGIN + "\n" + tool.END + "\n")
