"""The coordinator's OpenAPI document is the REST API's public contract: it must match the
stored copy ``tests/server/openapi.json``. After an intended change to the API, regenerate
the copy with ``.venv/bin/python tools/openapi.py`` and commit it with the change."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "openapi_tool", REPO_ROOT / "tools" / "openapi.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _differences(stored: Any, current: Any, where: str = "") -> list[str]:
    """The JSON paths at which two documents differ (for a readable failure)."""
    if isinstance(stored, dict) and isinstance(current, dict):
        found: list[str] = []
        for key in sorted(stored.keys() | current.keys()):
            if key not in current:
                found.append(f"{where}[{key!r}]: removed")
            elif key not in stored:
                found.append(f"{where}[{key!r}]: added")
            else:
                found.extend(_differences(stored[key], current[key], f"{where}[{key!r}]"))
        return found
    return [] if stored == current else [f"{where or 'the document'}: changed"]


def test_the_openapi_document_matches_the_stored_copy() -> None:
    tool = _tool()
    document = tool.openapi_document()
    stored_text = (REPO_ROOT / "tests" / "server" / "openapi.json").read_text()
    differences = _differences(json.loads(stored_text), document)
    assert not differences, (
        "the REST API's OpenAPI document changed; if intended, run "
        "`.venv/bin/python tools/openapi.py` and commit tests/server/openapi.json:\n  "
        + "\n  ".join(differences[:40])
    )
    # The copy is stored in the tool's one form, so that a regenerated copy's diff is the change.
    assert stored_text == tool.render(document)


def test_the_comparison_sees_a_changed_route() -> None:
    stored = {"paths": {"/api/runs": {"get": {"summary": "List runs"}}}}
    current = {"paths": {"/api/runs": {"get": {"summary": "Runs"}}, "/api/new": {}}}
    assert _differences(stored, current) == [
        "['paths']['/api/new']: added",
        "['paths']['/api/runs']['get']['summary']: changed",
    ]
