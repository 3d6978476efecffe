"""The two installs, from a wheel built from the repository's files, each in a fresh virtual
environment: ``pip install swarmgrad`` (the volunteer's) holds no server stack and joins a run;
``pip install "swarmgrad[coordinator]"`` migrates a fresh database with the migrations it ships
and serves.

Nothing is downloaded: each environment sees, through a ``.pth`` file, a directory of links to
exactly the distributions its requirements name (walked from the wheel's own metadata, with
the versions this test environment has), and pip installs the wheel with ``--no-index`` and
no configuration, so an install that needs anything more fails instead of fetching it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from sqlalchemy import create_engine, inspect, text

from server.db import alembic_config
from swarmgrad.extras import COORDINATOR_INSTALL
from swarmgrad.local import free_port
from swarmlab.node_process import wait_until
from tests.conftest import scaled

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_STACK = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "psycopg")
SECRET_KEY = "installs-secret-" + "s" * 40
ADMIN_TOKEN = "installs-admin-" + "a" * 40


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a copy of the repository's files (the build leaves nothing behind)."""
    root = tmp_path_factory.mktemp("wheel")
    source, dist = root / "source", root / "dist"
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
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*pip, "--wheel-dir", str(dist), str(source)],
        cwd=root,
        env=_pip_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (built,) = dist.glob("swarmgrad-*.whl")
    return built


def _pip_env() -> dict[str, str]:
    """No pip configuration (this machine's points at local indexes and wheels)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text_ = archive.read(metadata).decode()
    return [
        Requirement(line.split(":", 1)[1])
        for line in text_.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def _wanted(requirement: Requirement, extras: set[str]) -> bool:
    marker = requirement.marker
    return marker is None or any(marker.evaluate({"extra": e}) for e in extras | {""})


def closure(wheel: Path, extras: set[str]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions that ``swarmgrad[extras]`` needs, by canonical name."""
    found: dict[str, importlib.metadata.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    pending = [(r, extras) for r in _requirements(wheel)]
    while pending:
        requirement, wanted_extras = pending.pop()
        name = canonicalize_name(requirement.name)
        if not _wanted(requirement, wanted_extras) or (name, frozenset(requirement.extras)) in seen:
            continue
        seen.add((name, frozenset(requirement.extras)))
        dist = importlib.metadata.distribution(requirement.name)
        found[name] = dist
        pending += [(Requirement(r), set(requirement.extras)) for r in dist.requires or []]
    return found


def fresh_environment(path: Path, wheel: Path, extras: set[str]) -> Path:
    """A virtual environment with ``pip install --no-index wheel[extras]``; its ``bin``."""
    view = path / "view"
    for dist in closure(wheel, extras).values():
        for file in dist.files or []:
            if ".." in file.parts:  # scripts and data outside site-packages
                continue
            target = view / file
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(Path(str(dist.locate_file(file))).resolve())
    environment = path / "venv"
    venv.EnvBuilder(with_pip=False).create(environment)
    purelib = sysconfig.get_path("purelib", vars={"base": str(environment)})
    Path(purelib, "_dependencies.pth").write_text(f"{view}\n")
    bin_ = environment / "bin"
    requirement = f"{wheel}[{','.join(sorted(extras))}]" if extras else str(wheel)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(bin_ / "python"), "install"),
            *("--quiet", "--no-index", "--no-cache-dir", requirement),
        ],
        env=_pip_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return bin_


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARMGRAD_", "PYTHON"))}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def volunteer(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_environment(tmp_path_factory.mktemp("volunteer"), wheel, set())


@pytest.fixture(scope="session")
def full(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_environment(tmp_path_factory.mktemp("coordinator"), wheel, {"coordinator"})


@pytest.fixture(scope="module")
def coordinator(full: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``swarmgrad coordinator`` of the full install on a fresh SQLite file; its URL."""
    directory = tmp_path_factory.mktemp("served")
    port = free_port()
    process = subprocess.Popen(
        [
            *(str(full / "swarmgrad"), "coordinator", "--host", "127.0.0.1", "--port", str(port)),
            *("--database-url", f"sqlite:///{directory / 'served.db'}", "--log-level", "warning"),
        ],
        cwd=directory,
        env=_env(
            SWARMGRAD_ENVIRONMENT="production",
            SWARMGRAD_SECRET_KEY=SECRET_KEY,
            SWARMGRAD_ADMIN_TOKEN=ADMIN_TOKEN,
            SWARMGRAD_CHECKPOINT_DIR=str(directory / "checkpoints"),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, "the coordinator exited"
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert wait_until(healthy, scaled(60), interval=0.1)
        yield url
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
        assert "Traceback" not in output, output
        engine = create_engine(f"sqlite:///{directory / 'served.db'}")
        try:
            with engine.connect() as connection:
                head = connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
            # the repository's newest migration: the wheel ships every one
            assert head == ScriptDirectory.from_config(alembic_config()).get_current_head()
        finally:
            engine.dispose()


def test_the_volunteer_install_has_no_server_stack(wheel: Path, volunteer: Path) -> None:
    names = set(closure(wheel, set()))
    assert not names & {canonicalize_name(n) for n in SERVER_STACK}, sorted(names)
    script = (
        "import importlib.util, sys\n"
        "import peer, peer.coordinator, swarmgrad.cli, swarmgrad.join\n"
        f"stack = {SERVER_STACK!r}\n"
        "print(sorted(n for n in stack if importlib.util.find_spec(n)))\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in stack + ('server',)))\n"
    )
    done = subprocess.run(
        [str(volunteer / "python"), "-c", script], env=_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "[]"]


@pytest.mark.parametrize("command", ["coordinator", "demo"])
def test_without_the_extra_the_coordinator_commands_say_how_to_install_it(
    volunteer: Path, command: str
) -> None:
    done = subprocess.run(
        [str(volunteer / "swarmgrad"), command], env=_env(), capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: ") and line.endswith(COORDINATOR_INSTALL), line
    assert "fastapi" in line


def test_the_full_install_migrates_from_the_shipped_migrations(full: Path, tmp_path: Path) -> None:
    database = tmp_path / "fresh.db"
    script = (
        "import server, server.db as db\n"
        "from sqlalchemy import create_engine\n"
        f"db.upgrade_database(create_engine('sqlite:///{database}'))\n"
        "print(server.__file__)\n"
        "print(db.MIGRATIONS_DIR)\n"
    )
    done = subprocess.run(
        [str(full / "python"), "-c", script],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    module, migrations = map(Path, done.stdout.split())
    environment = full.parent
    assert module.is_relative_to(environment) and migrations.is_relative_to(environment)
    shipped = sorted(p.name for p in (migrations / "versions").glob("*.py"))
    assert shipped == sorted(p.name for p in (REPO_ROOT / "migrations" / "versions").glob("*.py"))
    assert (migrations / "script.py.mako").is_file()  # for `alembic revision`
    engine = create_engine(f"sqlite:///{database}")
    try:
        assert {"runs", "peers", "checkpoints"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_the_full_install_serves_its_pages(coordinator: str) -> None:
    answer = httpx.get(f"{coordinator}/healthz")
    assert answer.headers["X-Swarmgrad-Coordinator"] == "1"
    page = httpx.get(f"{coordinator}/")
    assert page.status_code == 200 and "<h1>Runs</h1>" in page.text
    script = httpx.get(f"{coordinator}/static/vendor/uplot/uPlot.iife.min.js")
    assert script.status_code == 200 and "uPlot" in script.text


def test_a_volunteer_install_joins_a_run_of_the_full_install(
    volunteer: Path, coordinator: str, tmp_path: Path
) -> None:
    organizer = _env(SWARMGRAD_URL=coordinator, SWARMGRAD_TOKEN=ADMIN_TOKEN)

    def swarmgrad(*args: str) -> dict[str, str]:
        done = subprocess.run(
            [str(volunteer / "swarmgrad"), *args, "--json"],
            env=organizer,
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
        assert done.returncode == 0, done.stderr
        answer: dict[str, str] = json.loads(done.stdout)
        return answer

    # no natural end: alone, a volunteer trains digits' 40 epochs in seconds, and could be
    # on its way out when the interrupt below comes
    run = swarmgrad("runs", "create", "installs", "--task", "digits", "--config", "epochs=100000")
    token = swarmgrad("invite", run["id"], "--uses", "1")["token"]
    process = subprocess.Popen(
        [
            *(str(volunteer / "swarmgrad"), "join", coordinator, "--token", token, "--quiet"),
            *("--data-dir", str(tmp_path / "volunteer"), "--host", "127.0.0.1"),
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def trained() -> bool:
        assert process.poll() is None, "the volunteer exited"
        progress = httpx.get(f"{coordinator}/api/v1/runs/{run['id']}/progress", timeout=5).json()
        return bool(progress["samples"] > 0)

    try:
        assert wait_until(trained, scaled(120), interval=0.5)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    assert process.returncode == 0, output
    assert "Traceback" not in output, output
