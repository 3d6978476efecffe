"""The volunteers' table one page at a time: the dashboard's document carries the run's
totals and one page; ``GET /runs/{id}/volunteers`` pages, sorts and filters on the server
(SQLite and PostgreSQL); the run's HTML page follows the same query without JavaScript."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from server.services.volunteer_table import View, view_from_query
from tests.server.conftest import Api


async def _swarm(app: FastAPI, api: Api, names_samples: list[tuple[str, int]]) -> str:
    run = await api.create_run(name="paged")
    invite = (await api.create_join_token(run["id"], max_uses=len(names_samples)))["token"]
    for name, samples in names_samples:
        peer = await api.join(run["id"], invite, display_name=name)
        if samples:
            answer = await api.report(run["id"], peer, epoch=1, samples=samples)
            assert answer.status_code == 202, answer.text
    await app.state.report_buffer.flush()
    return str(run["id"])


async def _page(client: httpx.AsyncClient, run_id: str, **query: Any) -> dict[str, Any]:
    answer = await client.get(f"/api/v1/runs/{run_id}/volunteers", params=query)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _names(document: dict[str, Any]) -> list[str]:
    return [v["display_name"] for v in document["volunteers"]]


SWARM = [("ann", 50), ("Bob", 70), ("cyd", 10), ("dan", 0), ("eve", 90), ("bobby", 30)]


async def test_the_dashboard_carries_one_page_and_the_counts(
    app: FastAPI, client: httpx.AsyncClient, api: Api
) -> None:
    run_id = await _swarm(app, api, SWARM)
    document = (await client.get(f"/api/v1/runs/{run_id}/dashboard?per_page=2")).json()
    assert _names(document) == ["eve", "Bob"]
    info = document["volunteers_page"]
    assert (info["page"], info["pages"], info["matching"], info["total"]) == (1, 3, 6, 6)
    assert info["online"] == 6  # joining counts as being seen
    assert (info["sort"], info["order"], info["q"]) == ("samples", "desc", "")
    assert document["headline"]["samples"] == 250  # totals cover every volunteer
    default = (await client.get(f"/api/v1/runs/{run_id}/dashboard")).json()
    assert len(default["volunteers"]) == 6 and default["volunteers_page"]["per_page"] == 50


async def test_pages_sort_and_filter_on_the_server(
    app: FastAPI, client: httpx.AsyncClient, api: Api
) -> None:
    run_id = await _swarm(app, api, SWARM)
    pages = [_names(await _page(client, run_id, page=n, per_page=4)) for n in (1, 2)]
    assert pages == [["eve", "Bob", "ann", "bobby"], ["cyd", "dan"]]
    by_name = await _page(client, run_id, sort="display_name", order="asc")
    assert _names(by_name) == ["ann", "Bob", "bobby", "cyd", "dan", "eve"]  # any case
    fewest = await _page(client, run_id, sort="samples", order="asc", per_page=2)
    assert _names(fewest) == ["dan", "cyd"]
    by_last_seen = await _page(client, run_id, sort="last_seen", order="asc")
    assert _names(by_last_seen) == [name for name, _ in SWARM]  # each seen after the one before
    found = await _page(client, run_id, q="BOB")
    assert _names(found) == ["Bob", "bobby"]
    info = found["volunteers_page"]
    assert (info["matching"], info["total"], info["q"]) == (2, 6, "BOB")
    share = {v["display_name"]: v["share"] for v in found["volunteers"]}
    assert share["Bob"] == pytest.approx(70 / 250)  # of the whole run, not of the page
    # LIKE's wildcards are matched as themselves.
    assert _names(await _page(client, run_id, q="%")) == []
    assert _names(await _page(client, run_id, q="_")) == []


async def test_a_page_past_the_last_is_the_last(
    app: FastAPI, client: httpx.AsyncClient, api: Api
) -> None:
    run_id = await _swarm(app, api, SWARM)
    document = await _page(client, run_id, page=99, per_page=4)
    assert document["volunteers_page"]["page"] == 2 and _names(document) == ["cyd", "dan"]
    empty = await _page(client, run_id, q="nobody")
    assert empty["volunteers"] == [] and empty["volunteers_page"]["pages"] == 1


@pytest.mark.parametrize(
    "query",
    [
        {"page": 0},
        {"per_page": 201},
        {"per_page": 0},
        {"sort": "secret"},
        {"order": "sideways"},
        {"q": "x" * 65},
    ],
)
async def test_bad_queries_get_a_clear_422(
    app: FastAPI, client: httpx.AsyncClient, api: Api, query: dict[str, Any]
) -> None:
    run_id = await _swarm(app, api, [("ann", 1)])
    for path in ("volunteers", "dashboard"):
        answer = await client.get(f"/api/v1/runs/{run_id}/{path}", params=query)
        assert answer.status_code == 422, (path, answer.text)
        assert next(iter(query)) in answer.text


async def test_an_unknown_run_has_no_volunteers(client: httpx.AsyncClient) -> None:
    assert (await client.get("/api/v1/runs/nope/volunteers")).status_code == 404


async def test_the_html_page_follows_the_query_without_javascript(
    app: FastAPI, client: httpx.AsyncClient, api: Api
) -> None:
    run_id = await _swarm(app, api, SWARM)
    page = (await client.get(f"/runs/{run_id}?page=2&per_page=4")).text
    assert ">cyd</a>" in page and ">eve</a>" not in page
    assert "Page 2 of 2: 6 volunteers, 6 online" in page
    assert 'id="volunteers-previous" rel="prev" href="/runs/' in page
    assert "page=1&amp;sort=samples&amp;order=desc" in page
    found = (await client.get(f"/runs/{run_id}?q=bob&sort=display_name&order=asc")).text
    assert "2 matching of 6" in found and ">ann</a>" not in found and ">bobby</a>" in found
    # Values that do not fit fall back to the defaults instead of failing the page.
    odd = await client.get(f"/runs/{run_id}?page=x&sort=secret&order=up&per_page=9999")
    assert odd.status_code == 200 and "Page 1 of 1" in odd.text


def test_a_view_refuses_what_the_query_bounds_refuse() -> None:
    with pytest.raises(ValueError, match="per_page"):
        View(per_page=0)
    with pytest.raises(ValueError, match="sort"):
        View(sort="secret")  # type: ignore[arg-type]
    assert view_from_query({"q": "y" * 100}).q == "y" * 64
    assert view_from_query({"order": "asc", "sort": "online_s"}) == View(
        sort="online_s", order="asc"
    )
