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

from server.web.security import (
    CSRF_COOKIE,
    ORGANIZER_COOKIE,
    RedactInvites,
    csrf_token,
    install_log_redaction,
)
from tests.server.conftest import ADMIN_TOKEN, SECRET_KEY, Api

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


async def csrf_of(client: httpx.AsyncClient, path: str = "/signin") -> str:
    page = await client.get(path)
    assert page.status_code == 200, page.text
    found = CSRF.search(page.text)
    session = client.cookies.get(ORGANIZER_COOKIE) or client.cookies.get(CSRF_COOKIE)
    assert found and session and found.group(1) == csrf_token(SECRET_KEY, session)
    return found.group(1)


def forget_credentials(client: httpx.AsyncClient) -> None:
    """As another browser would: no credential kept from an invite page."""
    for cookie in list(client.cookies.jar):
        if cookie.name.startswith("swarmgrad_credential_"):
            client.cookies.jar.clear(cookie.domain, cookie.path, cookie.name)


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
    assert joined.status_code == 303
    shown = await client.get(joined.headers["location"])
    assert shown.status_code == 200 and "Your credential" in shown.text

    revoked = await client.post(f"/runs/{run['id']}/invites/{token_id}/revoke", data={"csrf": csrf})
    assert revoked.status_code == 303
    forget_credentials(client)  # another browser than the one that joined
    gone = await client.get(f"/join/{invite}")
    assert gone.status_code == 410 and "This invite was revoked." in gone.text

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
    assert answer.status_code == 303
    answer = await client.get(answer.headers["location"])
    assert "&lt;b&gt;ana&lt;/b&gt;" in answer.text and "<b>ana</b>" not in answer.text
    token = re.search(r'id="credential"[^>]*>([^<]+)<', answer.text)
    assert token
    command = re.search(r'id="join-command"[^>]*>(.+?)</code>', answer.text)
    assert command
    args = re.findall(r'<span class="arg">([^<]+)</span>', command.group(1))
    assert args == ["swarmgrad", "join", "http://127.0.0.1:8000", "--token", token.group(1)]
    client.cookies.clear()  # another browser
    again = await client.get(f"/join/{invite}")
    assert again.status_code == 410 and "This invite has been used up." in again.text


async def test_the_credential_page_follows_post_redirect_get_and_spends_one_use(
    client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    invite = (await api.create_join_token(run["id"], max_uses=3))["token"]
    csrf = await csrf_of(client, f"/join/{invite}")
    posted = await client.post(f"/join/{invite}", data={"csrf": csrf, "display_name": "ada"})
    assert posted.status_code == 303
    location = posted.headers["location"]
    assert location == f"/join/{invite}/credential"
    cookie = next(
        h for h in posted.headers.get_list("set-cookie") if h.startswith("swarmgrad_credential_")
    )
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and f"Path=/join/{invite}" in cookie
    token = re.compile(r'id="credential"[^>]*>([^<]+)<')
    first = token.search((await client.get(location)).text)
    reloaded = await client.get(location)  # a reload: the same credential
    assert first and reloaded.status_code == 200
    assert token.search(reloaded.text).group(1) == first.group(1)  # type: ignore[union-attr]
    # The form sent again (back, then submit), and the invite page opened again: the same.
    again = await client.post(f"/join/{invite}", data={"csrf": csrf, "display_name": "ada2"})
    assert again.status_code == 303 and again.headers["location"] == location
    assert (await client.get(f"/join/{invite}")).headers["location"] == location
    tokens = (await api.client.get(f"/api/v1/runs/{run['id']}/tokens", headers={
        "Authorization": f"Bearer {ADMIN_TOKEN}"})).json()["tokens"]  # fmt: skip
    assert next(t["uses"] for t in tokens if t["max_uses"] == 3) == 1
    dashboard = (await api.client.get(f"/api/v1/runs/{run['id']}/dashboard")).json()
    names = [v["display_name"] for v in dashboard["volunteers"]]
    assert names == ["ada"]
    # A forged or another invite's cookie shows nothing.
    client.cookies.clear()
    assert (await client.get(location)).headers["location"] == f"/join/{invite}"


async def test_display_names_are_unique_per_run_whatever_their_case(
    client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    invite = (await api.create_join_token(run["id"], max_uses=5))["token"]
    csrf = await csrf_of(client, f"/join/{invite}")
    assert (
        await client.post(f"/join/{invite}", data={"csrf": csrf, "display_name": "Ada"})
    ).status_code == 303
    forget_credentials(client)  # a second person, same invite
    taken = await client.post(f"/join/{invite}", data={"csrf": csrf, "display_name": " ADA "})
    assert taken.status_code == 422
    assert "The display name “ADA” is already taken in this run; choose another." in taken.text
    assert 'aria-invalid="true"' in taken.text
    tokens = (await api.client.get(f"/api/v1/runs/{run['id']}/tokens", headers={
        "Authorization": f"Bearer {ADMIN_TOKEN}"})).json()["tokens"]  # fmt: skip
    assert next(t["uses"] for t in tokens if t["max_uses"] == 5) == 1  # nothing spent
    other = await client.post(f"/join/{invite}", data={"csrf": csrf, "display_name": "Adam"})
    assert other.status_code == 303


async def test_invite_errors_answer_404_or_410(
    client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    made_up = await client.get("/join/sgj_0123456789abcdef_nope")
    assert made_up.status_code == 404 and "This invite is not valid." in made_up.text
    assert (await client.get("/join/garbage")).status_code == 404
    invite = await api.create_join_token(run["id"])
    await api.client.delete(
        f"/api/v1/runs/{run['id']}/tokens/{invite['id']}",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    revoked = await client.get(f"/join/{invite['token']}")
    assert revoked.status_code == 410 and "revoked" in revoked.text


async def test_unknown_pages_render_as_pages(client: httpx.AsyncClient) -> None:
    answer = await client.get("/runs/nosuchrun")
    assert answer.status_code == 404 and "<h1>No such run</h1>" in answer.text
    assert "Something went wrong" not in answer.text
    assert answer.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]


async def test_unknown_paths_answer_html_to_browsers_and_json_to_the_api(
    client: httpx.AsyncClient,
) -> None:
    browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    page = await client.get("/no/such/page", headers=browser)
    assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
    assert "<h1>Page not found</h1>" in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for path, headers in (("/api/v1/nothing", browser), ("/no/such/page", {})):
        answer = await client.get(path, headers=headers)
        assert answer.status_code == 404, path
        assert answer.headers["content-type"] == "application/json", path
        assert answer.json() == {"detail": "Not Found"}


async def test_organizer_actions_follow_the_run_state_and_finish_is_confirmed(
    client: httpx.AsyncClient, run: dict[str, Any]
) -> None:
    await sign_in(client)
    page = (await client.get(f"/runs/{run['id']}")).text
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    assert re.search(r'data-enabled-when="running">Pause', page)
    assert re.search(r'data-enabled-when="paused" disabled>Resume', page)
    resume = await client.post(f"/runs/{run['id']}/actions/resume", data={"csrf": csrf})
    assert resume.status_code == 409 and "cannot be resumed" in resume.text
    # Finish without the confirmation page's answer only leads to that page.
    unconfirmed = await client.post(f"/runs/{run['id']}/actions/finish", data={"csrf": csrf})
    assert unconfirmed.status_code == 303
    assert unconfirmed.headers["location"] == f"/runs/{run['id']}/finish"
    assert (await client.get(f"/api/v1/runs/{run['id']}")).json()["status"] == "running"
    confirm = await client.get(unconfirmed.headers["location"])
    assert confirm.status_code == 200 and "This cannot be undone." in confirm.text
    done = await client.post(
        f"/runs/{run['id']}/actions/finish", data={"csrf": csrf, "confirm": "yes"}
    )
    assert done.status_code == 303
    assert (await client.get(f"/api/v1/runs/{run['id']}")).json()["status"] == "finished"
    page = (await client.get(f"/runs/{run['id']}")).text
    assert re.search(r'data-enabled-when="running" disabled>Pause', page)
    assert re.search(r'data-enabled-when="running paused" disabled>Finish', page)
    assert (await client.get(f"/runs/{run['id']}/finish")).status_code == 409


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
