"""The pages through the ASGI app (SQLite and PostgreSQL): organizer sign-in cookie, CSRF on
every form, what anonymous callers cannot do, the invite form without JavaScript, and invite
tokens kept out of the access log. (Rendering in a real browser: tests/web.)"""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from server.web.security import CSRF_COOKIE, ORGANIZER_COOKIE, RedactInvites, install_log_redaction
from tests.server.conftest import ADMIN_TOKEN, Api

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


async def csrf_of(client: httpx.AsyncClient, path: str = "/signin") -> str:
    page = await client.get(path)
    assert page.status_code == 200, page.text
    found = CSRF.search(page.text)
    assert found and client.cookies.get(CSRF_COOKIE) == found.group(1)
    return found.group(1)


async def sign_in(client: httpx.AsyncClient) -> None:
    csrf = await csrf_of(client)
    answer = await client.post("/signin", data={"csrf": csrf, "token": ADMIN_TOKEN, "next": "/"})
    assert answer.status_code == 303, answer.text


async def test_sign_in_sets_a_strict_http_only_cookie(client: httpx.AsyncClient) -> None:
    csrf = await csrf_of(client)
    wrong = await client.post("/signin", data={"csrf": csrf, "token": "sgo_nope_nope"})
    assert wrong.status_code == 401 and "not a valid organizer token" in wrong.text
    answer = await client.post(
        "/signin", data={"csrf": csrf, "token": ADMIN_TOKEN, "next": "https://evil.example/"}
    )
    assert answer.status_code == 303 and answer.headers["location"] == "/"  # no open redirect
    cookie = next(
        h for h in answer.headers.get_list("set-cookie") if h.startswith(ORGANIZER_COOKIE)
    )
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert "Sign out" in (await client.get("/")).text


async def test_forms_refuse_a_missing_or_wrong_csrf_token(
    client: httpx.AsyncClient, run: dict[str, Any]
) -> None:
    await sign_in(client)
    for data in ({}, {"csrf": "forged"}):
        answer = await client.post(f"/runs/{run['id']}/actions/pause", data=data)
        assert answer.status_code == 403 and "did not come from this site" in answer.text
        assert answer.headers["content-type"].startswith("text/html")
    assert (await client.get(f"/api/v1/runs/{run['id']}")).json()["status"] == "running"


async def test_anonymous_callers_cannot_use_organizer_forms(
    client: httpx.AsyncClient, run: dict[str, Any]
) -> None:
    csrf = await csrf_of(client)
    for path in (
        f"/runs/{run['id']}/actions/finish",
        f"/runs/{run['id']}/invites",
        f"/runs/{run['id']}/volunteers/1/ban",
    ):
        answer = await client.post(path, data={"csrf": csrf})
        assert answer.status_code == 403 and "Sign in as an organizer" in answer.text, path
    assert (await client.get(f"/runs/{run['id']}/checkpoint.pt")).status_code == 403
    assert "Pause" not in (await client.get(f"/runs/{run['id']}")).text


async def test_organizer_forms_pause_resume_invite_revoke_and_ban(
    client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    await sign_in(client)
    csrf = await csrf_of(client, f"/runs/{run['id']}")
    for action, status in (("pause", "paused"), ("resume", "running")):
        answer = await client.post(f"/runs/{run['id']}/actions/{action}", data={"csrf": csrf})
        assert answer.status_code == 303
        assert (await client.get(f"/api/v1/runs/{run['id']}")).json()["status"] == status

    bad = await client.post(f"/runs/{run['id']}/invites", data={"csrf": csrf, "uses": "0"})
    assert bad.status_code == 422 and "at least 1" in bad.text
    made = await client.post(
        f"/runs/{run['id']}/invites", data={"csrf": csrf, "uses": "2", "expires_hours": "1"}
    )
    assert made.status_code == 303
    page = await client.get(made.headers["location"])
    link = re.search(r'id="invite-link"[^>]*>([^<]+)<', page.text)
    assert link, page.text
    invite = link.group(1).rsplit("/join/", 1)[1]
    tokens = (await api.client.get(f"/api/v1/runs/{run['id']}/tokens", headers={
        "Authorization": f"Bearer {ADMIN_TOKEN}"})).json()["tokens"]  # fmt: skip
    token_id = next(t["id"] for t in tokens if t["max_uses"] == 2)

    joined = await client.post(f"/join/{invite}", data={"csrf": csrf, "display_name": "zoe"})
    assert joined.status_code == 200 and "shown once" in joined.text

    revoked = await client.post(f"/runs/{run['id']}/invites/{token_id}/revoke", data={"csrf": csrf})
    assert revoked.status_code == 303
    assert "This invite was revoked." in (await client.get(f"/join/{invite}")).text

    volunteer = (await client.get(f"/api/v1/runs/{run['id']}/dashboard")).json()["volunteers"][0]
    banned = await client.post(
        f"/runs/{run['id']}/volunteers/{volunteer['id']}/ban", data={"csrf": csrf}
    )
    assert banned.status_code == 303
    after = (await client.get(f"/api/v1/runs/{run['id']}/dashboard")).json()["volunteers"][0]
    assert after["banned"] is True


async def test_the_invite_form_works_without_javascript(
    client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    invite = (await api.create_join_token(run["id"], max_uses=1))["token"]
    form = await client.get(f"/join/{invite}")
    assert form.status_code == 200 and "Display name" in form.text
    assert form.headers["cache-control"] == "no-store"
    csrf = CSRF.search(form.text)
    assert csrf
    empty = await client.post(f"/join/{invite}", data={"csrf": csrf.group(1), "display_name": " "})
    assert empty.status_code == 422 and "1 to 64 characters" in empty.text
    answer = await client.post(
        f"/join/{invite}", data={"csrf": csrf.group(1), "display_name": "<b>ana</b>"}
    )
    assert answer.status_code == 200
    assert "&lt;b&gt;ana&lt;/b&gt;" in answer.text and "<b>ana</b>" not in answer.text
    token = re.search(r'id="credential"[^>]*>([^<]+)<', answer.text)
    assert token
    assert f"swarmgrad join http://127.0.0.1:8000 --token {token.group(1)}" in answer.text
    again = await client.get(f"/join/{invite}")
    assert "This invite has been used up." in again.text


async def test_unknown_pages_render_as_pages(client: httpx.AsyncClient) -> None:
    answer = await client.get("/runs/nosuchrun")
    assert answer.status_code == 404 and "There is no such run." in answer.text
    assert answer.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]


def test_invite_tokens_never_reach_the_access_log(caplog: pytest.LogCaptureFixture) -> None:
    install_log_redaction()
    install_log_redaction()  # idempotent
    access = logging.getLogger("uvicorn.access")
    assert sum(isinstance(f, RedactInvites) for f in access.filters) == 1
    secret = "sgj_0123456789abcdef_s3cr3t"
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        access.info(
            '%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", f"/join/{secret}?x=1", "1.1", 200
        )
    assert secret not in caplog.text and "/join/<redacted>?x=1" in caplog.text


async def test_pages_work_when_the_app_has_no_runs(app: FastAPI, client: httpx.AsyncClient) -> None:
    answer = await client.get("/")
    assert answer.status_code == 200 and "No runs yet" in answer.text
