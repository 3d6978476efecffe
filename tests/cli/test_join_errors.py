"""``swarmgrad join`` refused, in a child process as volunteers run it: every way it can fail
before training prints one line ``error: ...`` on stderr, exits non-zero, no traceback."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from peer.formats.payloads import TokenCreated
from tests.cli.conftest import Coordinator, Result, run_swarmgrad
from tests.conftest import free_port


def join(url: str, *args: str, data_dir: Path) -> Result:
    return run_swarmgrad("join", url, "--data-dir", str(data_dir), "--quiet", *args)


def new_run(coordinator: Coordinator, **invite: Any) -> tuple[str, TokenCreated]:
    with coordinator.client() as client:
        run = client.create_run(coordinator.admin_token, "r", "digits", {})
        created = client.create_invite(coordinator.admin_token, run.id, **invite)
    return run.id, created


def organizer_headers(coordinator: Coordinator) -> dict[str, str]:
    return {"Authorization": f"Bearer {coordinator.admin_token}"}


def test_missing_token_is_a_usage_error(tmp_path: Path) -> None:
    result = join("http://127.0.0.1:9", data_dir=tmp_path)
    assert "--token" in result.assert_one_error_line(code=2)


def test_not_a_url(tmp_path: Path) -> None:
    result = join("coordinator.example", "--token", "t", data_dir=tmp_path)
    assert "http" in result.assert_one_error_line(code=2)


def test_bad_device_value(tmp_path: Path) -> None:
    result = join("http://127.0.0.1:9", "--token", "t", "--device", "tpu", data_dir=tmp_path)
    result.assert_one_error_line(code=2)


def test_save_final_into_a_missing_directory(tmp_path: Path) -> None:
    where = tmp_path / "nowhere" / "final.pt"
    result = join(
        "http://127.0.0.1:9", "--token", "t", "--save-final", str(where), data_dir=tmp_path
    )
    assert "nowhere" in result.assert_one_error_line(code=2)


def test_unreachable_coordinator(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    join(url, "--token", "t", data_dir=tmp_path).assert_one_error_line(code=1)


def test_not_a_coordinator(other_server: str, tmp_path: Path) -> None:
    line = join(other_server, "--token", "t", data_dir=tmp_path).assert_one_error_line(code=1)
    assert "coordinator" in line


def test_unknown_token(coordinator: Coordinator, tmp_path: Path) -> None:
    join(coordinator.url, "--token", "x" * 40, data_dir=tmp_path).assert_one_error_line(code=1)


def test_expired_token(coordinator: Coordinator, tmp_path: Path) -> None:
    from sqlalchemy import create_engine, update

    from server.models import Token

    _, invite = new_run(coordinator)
    engine = create_engine(coordinator.database_url)
    try:
        with engine.begin() as connection:
            past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
            connection.execute(update(Token).where(Token.id == invite.id).values(expires_at=past))
    finally:
        engine.dispose()
    join(coordinator.url, "--token", invite.token, data_dir=tmp_path).assert_one_error_line(code=1)


def test_revoked_token(coordinator: Coordinator, tmp_path: Path) -> None:
    run_id, invite = new_run(coordinator)
    revoked = httpx.delete(
        f"{coordinator.url}/api/v1/runs/{run_id}/tokens/{invite.id}",
        headers=organizer_headers(coordinator),
    )
    assert revoked.status_code == 204
    join(coordinator.url, "--token", invite.token, data_dir=tmp_path).assert_one_error_line(code=1)


def test_used_up_token(coordinator: Coordinator, tmp_path: Path) -> None:
    from peer.formats.identity import Identity

    _, invite = new_run(coordinator, max_uses=1)
    with coordinator.client() as client:  # someone else joined with it
        client.join(invite.token, client.join_challenge(invite.token), Identity())
    join(coordinator.url, "--token", invite.token, data_dir=tmp_path).assert_one_error_line(code=1)


def test_run_not_accepting(coordinator: Coordinator, tmp_path: Path) -> None:
    run_id, invite = new_run(coordinator)
    with coordinator.client() as client:
        client.update_run(coordinator.admin_token, run_id, status="finished")
    result = join(coordinator.url, "--token", invite.token, data_dir=tmp_path)
    assert "finished" in result.assert_one_error_line(code=1)


def test_unknown_task(coordinator: Coordinator, tmp_path: Path) -> None:
    _, invite = new_run(coordinator)
    result = join(
        coordinator.url, "--token", invite.token, "--task", "nosuch.module:fn", data_dir=tmp_path
    )
    assert "nosuch" in result.assert_one_error_line(code=1)
    assert not (tmp_path / "identity.key").exists(), "refused before the invite was used"


def test_cuda_without_cuda(coordinator: Coordinator, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _, invite = new_run(coordinator)
    result = join(coordinator.url, "--token", invite.token, "--device", "cuda", data_dir=tmp_path)
    assert "cuda" in result.assert_one_error_line(code=1).lower()


def test_unwritable_data_dir(coordinator: Coordinator, tmp_path: Path) -> None:
    _, invite = new_run(coordinator)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = join(coordinator.url, "--token", invite.token, data_dir=blocker / "sub")
    assert "sub" in result.assert_one_error_line(code=1)
