"""deploy/compose.yaml: the file parses, its parts agree with each other, and its coordinator
services, started as plain processes with the file's commands and environment (no container
engine here), work as one coordinator: they share the database and the checkpoint directory.

What differs from the containers is only what a container provides: the database URL points
at the test PostgreSQL instead of the ``postgres`` service, the shared volume is a temporary
directory, and each coordinator listens on a loopback port of its own (no reverse proxy
here: the test talks to each coordinator directly, as Caddy would).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from peer.formats.identity import Identity
from server.config import Settings
from swarmlab.node_process import wait_until
from tests.conftest import MARKER_VARIABLE, free_port, marked_processes, scaled
from tests.server.conftest import REPO_ROOT, bearer, fresh_database, join_proof

DEPLOY = REPO_ROOT / "deploy"
# What deploy/.env holds in a real deployment.
DOTENV = {
    "SWARMGRAD_DOMAIN": "swarm.example.org",
    "SWARMGRAD_SECRET_KEY": "deploy-test-secret-" + "k" * 40,
    "POSTGRES_PASSWORD": "deploy-test-password",
}
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([?-])([^}]*))?\}")


def interpolate(value: Any, variables: dict[str, str]) -> Any:
    """Compose's ``${NAME}``, ``${NAME:-default}`` and ``${NAME:?error}`` in every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, kind, rest = match.groups()
        if variables.get(name):
            return variables[name]
        if kind == "?":
            raise KeyError(f"{name}: {rest}")
        return rest if kind == "-" else ""

    return _VARIABLE.sub(substitute, value)


def compose(variables: dict[str, str] = DOTENV) -> dict[str, Any]:
    document = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return {k: v for k, v in interpolate(document, variables).items() if not k.startswith("x-")}


def coordinators(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in document["services"].items()
        if service.get("command", [None])[0] == "coordinator"
    }


def test_the_compose_file_is_complete_and_consistent() -> None:
    document = compose()
    services = coordinators(document)
    assert len(services) >= 2, "several coordinators behind the proxy"
    caddy = document["services"]["caddy"]
    proxy_address = caddy["networks"]["backend"]["ipv4_address"]
    upstreams = re.search(r"reverse_proxy ([^{]+)\{", (DEPLOY / "Caddyfile").read_text())
    assert upstreams is not None
    assert set(upstreams.group(1).split()) == {f"{name}:8000" for name in services}
    for name, service in services.items():
        command = service["command"]
        assert command[command.index("--host") + 1] == "0.0.0.0"
        assert command[command.index("--port") + 1] == "8000"
        settings = Settings(
            **{  # what the container's environment gives the coordinator
                key.removeprefix("SWARMGRAD_").lower(): value
                for key, value in service["environment"].items()
            }
        )
        assert settings.trusted_proxies == (proxy_address,), name
        assert settings.database_url.startswith("postgresql+psycopg://swarmgrad:")
        assert "@postgres:5432/" in settings.database_url
        assert settings.public_url == "https://swarm.example.org"
        # Checkpoints and the spill on the one volume every coordinator mounts.
        [mount] = service["volumes"]
        volume, path = mount.split(":")
        assert volume in document["volumes"]
        assert settings.checkpoint_dir.is_relative_to(path)
        assert settings.spill_dir.is_relative_to(path)
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert len({str(s["volumes"]) for s in services.values()}) == 1
    assert len({str(s["environment"]) for s in services.values()}) == 1


def test_a_missing_secret_stops_compose_with_a_clear_line() -> None:
    with pytest.raises(KeyError, match="SWARMGRAD_SECRET_KEY"):
        compose({**DOTENV, "SWARMGRAD_SECRET_KEY": ""})


def cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from swarmgrad.cli import main; main()", *args]


@contextlib.contextmanager
def started(
    services: dict[str, dict[str, Any]], database_url: str, shared: Path, marker: str
) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """Each coordinator service as a process; yields the environment they share and each
    one's URL."""
    [mount] = next(iter(services.values()))["volumes"]
    inside = mount.split(":")[1]
    environment = {
        key: value.replace(inside, str(shared), 1) if value.startswith(inside) else value
        for key, value in next(iter(services.values()))["environment"].items()
    }
    environment["SWARMGRAD_DATABASE_URL"] = database_url
    base = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
    env = {**base, **environment, MARKER_VARIABLE: marker}
    processes, urls = [], {}
    try:
        for name, service in services.items():
            command = list(service["command"])
            port = free_port()
            command[command.index("--host") + 1] = "127.0.0.1"
            command[command.index("--port") + 1] = str(port)
            processes.append(subprocess.Popen(cli(*command), env=env, cwd=shared))
            urls[name] = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            for process in processes:
                assert process.poll() is None, "a coordinator exited at start"
            with contextlib.suppress(httpx.TransportError):
                return all(
                    httpx.get(f"{url}/healthz", timeout=2).status_code == 200
                    for url in urls.values()
                )
            return False

        assert wait_until(healthy, scaled(90), interval=0.3)
        yield env, urls
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=scaled(30))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.mark.slow
@pytest.mark.postgres
def test_the_compose_coordinators_share_the_database_and_checkpoints(tmp_path: Path) -> None:
    services = coordinators(compose())
    marker = f"deploy-{os.getpid()}-{tmp_path.name}"
    shared = tmp_path / "shared"
    shared.mkdir()
    with (
        fresh_database("postgresql", tmp_path) as database_url,
        started(services, database_url, shared, marker) as (env, urls),
    ):
        # The organizer's first token, as docs/deploy.md has it made (in a container: `docker
        # compose run --rm coordinator-1 coordinator admin-token`).
        made = subprocess.run(
            cli("coordinator", "admin-token", "--label", "deploy test"),
            env=env,
            cwd=shared,
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
        assert made.returncode == 0, made.stderr
        organizer = bearer(made.stdout.strip().splitlines()[-1])
        first, *others = urls.values()
        with httpx.Client(base_url=first, timeout=scaled(30)) as http:
            run = http.post(
                "/api/v1/runs", json={"name": "deployed", "task": "none"}, headers=organizer
            ).json()
            invite = http.post(
                f"/api/v1/runs/{run['id']}/tokens", json={}, headers=organizer
            ).json()["token"]
            challenge = http.post("/api/v1/join/challenge", headers=bearer(invite)).json()
            joined = http.post(
                f"/api/v1/runs/{run['id']}/join",
                json={
                    **join_proof(run["id"], challenge["challenge"], Identity()),
                    "addresses": [],
                    "client_mode": True,
                },
                headers=bearer(invite),
            )
            assert joined.status_code == 200, joined.text
            peer = bearer(joined.json()["peer_token"])
            archive = b"PK\x03\x04" + os.urandom(5000)
            upload = http.put(
                f"/api/v1/runs/{run['id']}/checkpoint",
                params={"epoch": 0},
                content=archive,
                headers={**peer, "Content-Type": "application/octet-stream"},
            )
            assert upload.status_code == 201, upload.text
        # Every coordinator knows the peer that joined through the first one, takes its
        # reports, and serves the checkpoint the first one stored.
        for n, url in enumerate(urls.values(), start=1):
            with httpx.Client(base_url=url, timeout=scaled(30)) as http:
                report = {"epoch": 0, "samples": 100 * n, "samples_per_second": 1.0}
                answer = http.post(f"/api/v1/runs/{run['id']}/reports", json=report, headers=peer)
                assert answer.status_code == 202, (url, answer.text)
                download = http.get(f"/api/v1/runs/{run['id']}/checkpoint", headers=peer)
                assert download.status_code == 200 and download.content == archive, url
        last = 100 * len(urls)
        with httpx.Client(base_url=others[-1], timeout=scaled(30)) as http:

            def samples() -> bool:
                progress = http.get(f"/api/v1/runs/{run['id']}/progress").json()
                return bool(progress["samples"] == last)

            assert wait_until(samples, scaled(30), interval=0.2)
        assert len(list((shared / "checkpoints").rglob("*"))) >= 1
    assert wait_until(lambda: marked_processes(marker) == [], scaled(30))
