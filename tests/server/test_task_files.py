"""A run that ships its task file: stored by SHA-256, named in the run's public description,
handed to the run's invitees, peers and organizers only; bounded and checked on the way in."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import httpx

from peer.formats.task_files import MAX_TASK_FILE_BYTES
from tests.server.conftest import ORGANIZER, Api, bearer

SOURCE = b"def make():\n    raise NotImplementedError\n"


def task_file(data: bytes = SOURCE, **extra: Any) -> dict[str, Any]:
    return {"filename": "my_task.py", "content": base64.b64encode(data).decode(), **extra}


async def create(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post(
        "/api/v1/runs", json={"name": "shipped", "task": "my_task:make", **body}, headers=ORGANIZER
    )


async def test_a_run_ships_its_task_file_with_its_digest_and_requirements(
    api: Api, client: httpx.AsyncClient
) -> None:
    digest = hashlib.sha256(SOURCE).hexdigest()
    created = await create(client, task_file=task_file(requirements=["numpy>=1.26"]))
    assert created.status_code == 201, created.text
    run = created.json()
    described = {
        "filename": "my_task.py",
        "sha256": digest,
        "size": len(SOURCE),
        "requirements": ["numpy>=1.26"],
    }
    assert run["task_file"] == described
    assert (await client.get(f"/api/v1/runs/{run['id']}")).json()["task_file"] == described
    listed = (await client.get("/api/v1/runs")).json()["runs"]
    assert [r["task_file"] for r in listed] == [described]

    invite = (await api.create_join_token(run["id"]))["token"]
    for token in (invite, ORGANIZER["Authorization"].removeprefix("Bearer ")):
        answer = await client.get(f"/api/v1/runs/{run['id']}/task", headers=bearer(token))
        assert answer.status_code == 200, answer.text
        assert answer.content == SOURCE and answer.headers["X-Task-SHA256"] == digest

    # a second run of the same file stores it once and ships it alike
    again = await create(client, task_file=task_file())
    assert again.json()["task_file"] == {**described, "requirements": []}


async def test_only_the_runs_own_tokens_read_its_task_file(
    api: Api, client: httpx.AsyncClient
) -> None:
    run = (await create(client, task_file=task_file())).json()
    other = await api.create_run("other")
    other_invite = (await api.create_join_token(other["id"]))["token"]
    path = f"/api/v1/runs/{run['id']}/task"
    assert (await client.get(path)).status_code == 401
    assert (await client.get(path, headers=bearer(other_invite))).status_code == 403
    # a run without one: 404, saying its task is installed
    answer = await client.get(f"/api/v1/runs/{other['id']}/task", headers=bearer(other_invite))
    assert answer.status_code == 404 and "installed" in answer.json()["detail"]
    assert other["task_file"] is None


async def test_a_task_file_is_bounded_and_checked(client: httpx.AsyncClient) -> None:
    too_large = b"#" * (MAX_TASK_FILE_BYTES + 1)
    refused: list[tuple[dict[str, Any], str]] = [
        ({"task_file": task_file(too_large)}, "at most"),
        ({"task_file": task_file(b"")}, "empty"),
        ({"task_file": {**task_file(), "content": "not base64!"}}, "base64"),
        ({"task_file": {**task_file(), "filename": "my-task.py"}}, "module"),
        ({"task_file": task_file(requirements=["--index-url=http://x"])}, "no pip options"),
        ({"task_file": task_file(requirements=["pkg @ https://x/p.whl"])}, "URLs"),
        ({"task_file": task_file(requirements=["../wheel.whl"])}, "paths"),
        ({"task_file": task_file(), "task": "other:make"}, "my_task:function"),
        ({"task_file": task_file(), "task": "my_task"}, "my_task:function"),
    ]
    for body, detail in refused:
        answer = await create(client, **body)
        assert answer.status_code == 422, (body, answer.text)
        assert detail in answer.text, (detail, answer.text)
    runs = (await client.get("/api/v1/runs")).json()["runs"]
    assert runs == []
