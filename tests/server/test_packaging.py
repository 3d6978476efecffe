"""The wheel's package list matches the source tree (the installs themselves are tested from a
built wheel in tests/test_installs.py)."""

from __future__ import annotations

import tomllib

from setuptools import find_packages

from tests.server.conftest import REPO_ROOT


def test_the_listed_packages_are_every_package_of_the_tree() -> None:
    """pyproject lists its packages (two are data directories, web/ and migrations/, mapped);
    a new package must be listed."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(where=str(REPO_ROOT), include=["peer*", "server*", "swarmgrad*"]))
    assert set(config["packages"]) == found | {"server.web.assets", "server.migrations"}
    assert config["package-dir"] == {"server.web.assets": "web", "server.migrations": "migrations"}
