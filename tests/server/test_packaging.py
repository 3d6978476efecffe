"""An installed coordinator (not the repository) migrates a fresh database and serves: the
Alembic scripts ship inside the package."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from peer.testing import wait_until
from server.db import alembic_config
from tests.conftest import scaled
from tests.server.conftest import REPO_ROOT, SECRET_KEY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install --no-deps --target`` of a copy of the repository's files (so that the
    build leaves nothing in the repository)."""
    root = tmp_path_factory.mktemp("packaging")
    source, target = root / "source", root / "site"
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        origin = REPO_ROOT / name
        if origin.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, source / name)
    result = subprocess.run(
        [
            sys.executable,
            *("-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"),
            *("--target", str(target), str(source)),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return target


def _env(target: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARMGRAD_", "PYTHON"))}
    # The installed copy first, then the venv's dependencies; `python -S` skips the venv's
    # .pth files, so the editable install of the repository is not importable at all.
    env["PYTHONPATH"] = os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]])
    env.update(SWARMGRAD_ENVIRONMENT="production", SWARMGRAD_SECRET_KEY=SECRET_KEY)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_installed_package_migrates_from_its_own_files(installed: Path, tmp_path: Path) -> None:
    database = tmp_path / "fresh.db"
    script = (
        "import server, server.db as db\n"
        "from sqlalchemy import create_engine\n"
        f"engine = create_engine('sqlite:///{database}')\n"
        "db.upgrade_database(engine)\n"
        "print(server.__file__)\n"
        "print(db.MIGRATIONS_DIR)\n"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", script],
        cwd=tmp_path,
        env=_env(installed),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    module, migrations = result.stdout.split()
    assert Path(module).is_relative_to(installed) and Path(migrations).is_relative_to(installed)
    assert (Path(migrations) / "versions").is_dir()
    assert (Path(migrations) / "script.py.mako").is_file()  # for `alembic revision`
    engine = create_engine(f"sqlite:///{database}")
    try:
        assert {"runs", "peers", "checkpoints"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_installed_coordinator_serves(installed: Path, tmp_path: Path) -> None:
    port = _free_port()
    database = tmp_path / "served.db"
    process = subprocess.Popen(
        [
            sys.executable,
            *("-S", "-c", "from server.cli import app; app()"),
            *("--port", str(port), "--database-url", f"sqlite:///{database}"),
            *("--log-level", "warning"),
        ],
        cwd=tmp_path,
        env=_env(installed),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def healthy() -> bool:
        assert process.poll() is None, "the coordinator exited"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert wait_until(healthy, scaled(30), interval=0.1)
        response = httpx.get(f"http://127.0.0.1:{port}/healthz")
        assert response.headers["X-Swarmgrad-Coordinator"] == "1"
        # The pages and their static files come from the installed package, not the repository.
        page = httpx.get(f"http://127.0.0.1:{port}/")
        assert page.status_code == 200 and "<h1>Runs</h1>" in page.text
        script = httpx.get(f"http://127.0.0.1:{port}/static/vendor/uplot/uPlot.iife.min.js")
        assert script.status_code == 200 and "uPlot" in script.text
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert "Traceback" not in output, output
    engine = create_engine(f"sqlite:///{database}")
    try:
        assert "checkpoints" in inspect(engine).get_table_names()
        with engine.connect() as connection:
            head = connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
        # the repository's newest migration: the installed package ships every one
        assert head == ScriptDirectory.from_config(alembic_config()).get_current_head()
    finally:
        engine.dispose()


def test_the_listed_packages_are_every_package_of_the_tree() -> None:
    """pyproject lists its packages (two are data directories, web/ and migrations/, mapped);
    a new package must be listed."""
    import tomllib

    from setuptools import find_packages

    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(where=str(REPO_ROOT), include=["peer*", "server*", "swarmgrad*"]))
    assert set(config["packages"]) == found | {"server.web.assets", "server.migrations"}
    assert config["package-dir"] == {"server.web.assets": "web", "server.migrations": "migrations"}
