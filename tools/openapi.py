"""Write the coordinator's OpenAPI document to ``tests/server/openapi.json``.

``tests/server/test_openapi.py`` compares the coordinator's document with that stored copy, so
that a change to the REST API is a deliberate one. After an intended change, run::

    .venv/bin/python tools/openapi.py

and commit the new copy with the change. ``--check`` only compares, exiting 1 on a difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

STORED = Path(__file__).resolve().parents[1] / "tests" / "server" / "openapi.json"


def openapi_document() -> dict[str, Any]:
    """The document of a coordinator built with the default settings (nothing is served)."""
    from server.app import create_app
    from server.config import Settings

    with tempfile.TemporaryDirectory() as directory:
        settings = Settings(
            environment="development",
            secret_key="openapi-document-" + "k" * 32,
            database_url=f"sqlite:///{directory}/coordinator.db",
            migrate_on_start=False,
            spill_dir=Path(directory) / "spill",
            checkpoint_dir=Path(directory) / "checkpoints",
        )
        app = create_app(settings)
        document: dict[str, Any] = app.openapi()
        app.state.engine.dispose()
    return document


def render(document: dict[str, Any]) -> str:
    """The stored form: sorted keys, two-space indents, one final newline."""
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = parser.parse_args(argv)
    text = render(openapi_document())
    if args.check:
        if not STORED.exists() or STORED.read_text() != text:
            print(f"{STORED} differs from the coordinator's document: run tools/openapi.py")
            return 1
        return 0
    STORED.write_text(text)
    print(f"wrote {STORED}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(STORED.parents[2]))
    sys.exit(main())
