"""Safer defaults: a coordinator is in production unless told otherwise (a placeholder secret
stops it, with one line), `--dev` is the way to try it out, and every invite ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from server.app import create_app
from server.cli import app as cli
from server.config import Settings
from tests.server.conftest import (
    ORGANIZER,
    REPO_ROOT,
    Api,
    client_for,
    make_settings,
    running,
)
from tests.server.test_pages import csrf_of, sign_in


@pytest.fixture
def bare_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No ``SWARMGRAD_*`` variable set, in an empty directory. What the CLI writes into the
    environment (for uvicorn's workers) is undone afterwards too."""
    for key in ("SWARMGRAD_ENVIRONMENT", "SWARMGRAD_DATABASE_URL"):
        monkeypatch.setenv(key, "")  # recorded, so that the teardown removes it again
    for key in list(os.environ):
        if key.startswith("SWARMGRAD_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_default_environment_is_production(bare_environment: Path) -> None:
    with pytest.raises(ValidationError, match=r"refusing to start in production.*--dev"):
        Settings()
    assert Settings(secret_key="k" * 40).environment == "production"


def test_the_coordinator_refuses_a_placeholder_secret_in_one_line(
    bare_environment: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWARMGRAD_SECRET_KEY", "changeme")
    result = CliRunner().invoke(cli, [])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "SWARMGRAD_SECRET_KEY" in lines[0] and "--dev" in lines[0]
    assert not (bare_environment / "swarmgrad.db").exists()  # refused before migrating


def test_the_swarmgrad_command_says_it_in_one_line_without_a_traceback(
    bare_environment: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "swarmgrad", "coordinator"],
        cwd=bare_environment,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "refusing to start in production" in lines[0]


def test_dev_starts_with_a_warning(bare_environment: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    started: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: started.update(options))
    monkeypatch.setenv("SWARMGRAD_SECRET_KEY", "changethis")
    result = CliRunner().invoke(cli, ["--dev", "--port", "8123"])
    assert result.exit_code == 0, result.output
    assert started["port"] == 8123
    # The app resolves X-Forwarded-For from SWARMGRAD_TRUSTED_PROXIES; uvicorn must not.
    assert started["proxy_headers"] is False
    assert os.environ["SWARMGRAD_ENVIRONMENT"] == "development"  # for uvicorn's workers
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "SWARMGRAD_SECRET_KEY" in warnings[0]


@pytest.mark.parametrize("args", [["--dev", "admin-token"], ["admin-token", "--dev"]])
def test_dev_admin_token(bare_environment: Path, args: list[str]) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1].startswith("sgo_")
    assert (bare_environment / "swarmgrad.db").exists()


async def test_invites_without_limits_get_the_default_limits(tmp_path: Path) -> None:
    settings = make_settings(
        f"sqlite:///{tmp_path / 'c.db'}",
        join_token_default_max_uses=7,
        join_token_default_ttl_s=3600,
    )
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run = await api.create_run()
        before = time.time()
        made = await api.create_join_token(run["id"])
        assert made["max_uses"] == 7
        expires = datetime.fromisoformat(made["expires_at"]).timestamp()
        assert before + 3600 - 5 <= expires <= time.time() + 3600 + 5
        chosen = await api.create_join_token(run["id"], max_uses=2, expires_in_s=60)
        assert chosen["max_uses"] == 2

        # The run page's form says what an empty field gives, never "unlimited".
        await sign_in(client)
        csrf = await csrf_of(client, f"/runs/{run['id']}")
        page = (await client.get(f"/runs/{run['id']}")).text
        assert "unlimited" not in page
        assert 'name="uses" type="number" min="1" inputmode="numeric" placeholder="7"' in page
        assert 'placeholder="1"' in page  # hours
        made_by_form = await client.post(f"/runs/{run['id']}/invites", data={"csrf": csrf})
        assert made_by_form.status_code == 303
        tokens = await client.get(f"/api/v1/runs/{run['id']}/tokens", headers=ORGANIZER)
        assert all(t["max_uses"] is not None and t["expires_at"] for t in tokens.json()["tokens"])


def test_the_default_invite_limits(bare_environment: Path) -> None:
    settings = Settings(secret_key="k" * 40)
    assert settings.join_token_default_max_uses == 100
    assert settings.join_token_default_ttl_s == 7 * 24 * 3600
