"""The worker's cache of dashboard documents: fresh ones served as they are, stale ones served
while one background build replaces them, old ones rebuilt by the reader, one build at a time
per key; then the REST dashboard through it."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from server.app import create_app
from server.document_cache import DocumentCache
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.server.conftest import Api, client_for, make_settings, running


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Builds:
    """Numbered documents; ``gate`` (when set) holds a build until released."""

    def __init__(self) -> None:
        self.count = 0
        self.gate: threading.Event | None = None
        self.started = threading.Event()
        self.fail = False

    def __call__(self) -> str:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail:
            raise RuntimeError("the database is away")
        self.count += 1
        return f"doc{self.count}"


def test_stale_documents_are_served_while_one_is_built_behind_and_old_ones_by_the_reader() -> None:
    clock, build = Clock(), Builds()
    cache = DocumentCache(1.0, max_stale_s=5.0, clock=clock)
    assert cache.get("run", build) == "doc1"  # never built: the reader builds
    clock.now += 0.9
    assert cache.get("run", build) == "doc1" and build.count == 1  # fresh
    clock.now += 2.0  # stale: served as it is, the next one built behind the reader
    build.started.clear()
    build.gate = threading.Event()
    assert cache.get("run", build) == "doc1"
    assert build.started.wait(10) and cache.building("run")
    assert cache.get("run", build) == "doc1"  # still building: no reader waits, none builds
    build.gate.set()
    assert wait_until(lambda: not cache.building("run"), scaled(10))
    assert cache.get("run", build) == "doc2" and build.count == 2
    clock.now += 6.0  # too old to serve: the reader builds
    build.gate = None
    assert cache.get("run", build) == "doc3"


def test_nothing_is_built_that_no_reader_asked_for() -> None:
    """A reader costs at most one build: no key is rebuilt while nobody reads it, so asking
    for many views once each builds each once (a cache that kept them fresh by itself would
    let one client's requests set off many builds)."""
    build = Builds()
    cache = DocumentCache(0.05, max_stale_s=10.0)
    for key in range(20):
        cache.get(key, build)
    assert build.count == 20
    threading.Event().wait(0.5)  # ten times their age: time passing builds nothing
    assert build.count == 20
    cache.get(3, build)  # stale: served, and one build behind it
    assert wait_until(lambda: not cache.building(3), scaled(10))
    assert build.count == 21


def test_readers_of_a_document_never_built_wait_for_one_build() -> None:
    build = Builds()
    build.gate = threading.Event()
    cache = DocumentCache(10.0)
    answers: list[str] = []
    readers = [
        threading.Thread(target=lambda: answers.append(cache.get("run", build))) for _ in range(4)
    ]
    for reader in readers:
        reader.start()
    assert build.started.wait(10)
    build.gate.set()
    for reader in readers:
        reader.join(10)
    assert answers == ["doc1"] * 4 and build.count == 1


def test_a_failed_build_is_the_readers_error_and_the_next_reader_tries_again() -> None:
    clock, build = Clock(), Builds()
    cache = DocumentCache(1.0, max_stale_s=5.0, clock=clock)
    build.fail = True
    with pytest.raises(RuntimeError):
        cache.get("run", build)  # nothing to serve instead
    build.fail = False
    assert cache.get("run", build) == "doc1"
    clock.now += 2
    build.fail = True
    assert cache.get("run", build) == "doc1"  # stale: served; the build behind it fails...
    assert wait_until(lambda: not cache.building("run"), scaled(10))
    clock.now += 4  # ...and once too old, the reader builds and sees the error
    with pytest.raises(RuntimeError):
        cache.get("run", build)
    build.fail = False
    assert cache.get("run", build) == "doc2"


def test_keys_are_bounded_and_zero_age_builds_every_time() -> None:
    build = Builds()
    cache = DocumentCache(10.0, max_entries=3)
    for key in range(10):
        cache.get(key, build)
    assert len(cache) == 3
    off = DocumentCache(0.0)
    assert [off.get("run", build) for _ in range(3)] == ["doc11", "doc12", "doc13"]
    assert len(off) == 0


async def test_the_rest_dashboard_is_served_from_the_cache(database_url: str) -> None:
    app = create_app(make_settings(database_url, dashboard_cache_s=60.0))
    async with running(app), client_for(app) as client:
        api = Api(client)
        run = await api.create_run(name="cached", config={"epochs": 20})
        invite = (await api.create_join_token(run["id"]))["token"]
        peer = await api.join(run["id"], invite, display_name="ada")

        async def read(path: str) -> Any:
            answer = await client.get(path)
            assert answer.status_code == 200, answer.text
            return answer.json()

        path = f"/api/v1/runs/{run['id']}/dashboard"
        first, runs = await read(path), await read("/api/v1/dashboard")
        assert (await api.report(run["id"], peer, epoch=1, samples=300)).status_code == 202
        await app.state.report_buffer.flush()
        # Within the cache's age: the same documents, for the run and the runs list.
        assert await read(path) == first and await read("/api/v1/dashboard") == runs
        # Another view of the table is that page, read now, in the cached document: the
        # run-wide part is not built again for it.
        other = await read(path + "?q=ad")
        assert other["headline"] == first["headline"] and first["headline"]["samples"] == 0
        assert [v["samples"] for v in other["volunteers"]] == [300]
        assert other["volunteers_page"]["q"] == "ad" and other["version"] != first["version"]
        assert (await read(path + "?q=nobody"))["volunteers"] == []
        # An unknown run is still a 404, whatever the cache holds.
        assert (await client.get("/api/v1/runs/nosuchrun/dashboard")).status_code == 404
