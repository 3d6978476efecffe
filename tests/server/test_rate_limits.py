"""Rate limits: the token buckets as pure logic (time passed in by hand), then the endpoints
through the app with a client address that is not loopback."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from server.api.rate_limits import limiter_from_settings
from server.app import create_app
from server.config import Settings
from server.services.rate_limits import (
    Endpoint,
    RateLimit,
    RateLimiter,
    Refusal,
    TokenBuckets,
    address_key,
)
from tests.server.conftest import ORGANIZER, Api, JoinedPeer, bearer, make_settings, running

REMOTE = "203.0.113.5"
OTHER_REMOTE = "198.51.100.7"

# --------------------------------------------------------------------------- buckets


def test_a_bucket_allows_its_burst_then_one_request_per_interval() -> None:
    buckets = TokenBuckets(RateLimit(per_s=2.0, burst=3))
    for _ in range(3):
        assert buckets.wait("a", 10.0) == 0.0
        buckets.take("a", 10.0)
    assert buckets.wait("a", 10.0) == pytest.approx(0.5)
    assert buckets.wait("a", 10.25) == pytest.approx(0.25)
    assert buckets.wait("a", 10.5) == 0.0
    buckets.take("a", 10.5)
    assert buckets.wait("a", 10.5) == pytest.approx(0.5)
    assert buckets.wait("b", 10.5) == 0.0  # keys are independent


def test_a_bucket_refills_to_its_burst_and_no_further() -> None:
    buckets = TokenBuckets(RateLimit(per_s=1.0, burst=2))
    buckets.take("a", 0.0)
    buckets.take("a", 0.0)
    for _ in range(2):  # after an hour: still only the burst
        assert buckets.wait("a", 3600.0) == 0.0
        buckets.take("a", 3600.0)
    assert buckets.wait("a", 3600.0) > 0.0


def test_idle_buckets_are_forgotten_once_full() -> None:
    buckets = TokenBuckets(RateLimit(per_s=1.0, burst=10))
    buckets.take("old", 0.0)
    buckets.take("recent", 5.0)
    assert len(buckets) == 2
    buckets.take("new", 10.0)  # "old" is full again at 10 s: nothing lost by forgetting it
    assert len(buckets) == 2
    assert buckets.wait("recent", 10.0) == 0.0
    buckets.take("new", 20.0)
    assert len(buckets) == 1


def test_memory_is_bounded_even_under_a_flood_of_keys() -> None:
    buckets = TokenBuckets(RateLimit(per_s=0.001, burst=1), max_keys=100)
    for i in range(10_000):
        buckets.take(i, 1.0)
    assert len(buckets) == 100
    assert buckets.wait(9_999, 1.0) > 0  # the most recent are the ones kept


def test_a_limit_needs_a_positive_rate_and_burst() -> None:
    for per_s, burst in ((0.0, 1), (-1.0, 1), (float("nan"), 1), (1.0, 0)):
        with pytest.raises(ValueError):
            RateLimit(per_s, burst)


def test_a_refusal_charges_neither_bucket() -> None:
    limiter = RateLimiter(
        per_peer={Endpoint.REPORTS: RateLimit(1.0, 1)},
        per_address={Endpoint.REPORTS: RateLimit(1.0, 2)},
    )
    assert limiter.check(Endpoint.REPORTS, "addr", b"peer-1", 0.0) is None
    refused = limiter.check(Endpoint.REPORTS, "addr", b"peer-1", 0.0)
    assert refused == Refusal(Endpoint.REPORTS, "peer", pytest.approx(1.0))
    # peer-1's refusal took nothing from the address: peer-2 still gets its one
    assert limiter.check(Endpoint.REPORTS, "addr", b"peer-2", 0.0) is None
    refused = limiter.check(Endpoint.REPORTS, "addr", b"peer-3", 0.0)
    assert refused is not None and refused.by == "address"
    assert refused.reason == "rate_limit:reports"
    # other endpoints are not limited by these
    assert limiter.check(Endpoint.BOOTSTRAP, "addr", b"peer-1", 0.0) is None


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert Refusal(Endpoint.JOIN, "address", 0.01).retry_after_header == "1"
    assert Refusal(Endpoint.JOIN, "address", 1.0).retry_after_header == "1"
    assert Refusal(Endpoint.JOIN, "address", 1.2).retry_after_header == "2"


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("203.0.113.5", "203.0.113.5"),
        ("2001:db8:1:2::5", "2001:db8:1::/56"),
        ("2001:db8:1:ff:ffff:ffff:ffff:ffff", "2001:db8:1::/56"),
        ("2001:db8:1:100::5", "2001:db8:1:100::/56"),
        ("::ffff:203.0.113.5", "203.0.113.5"),
        ("127.0.0.1", None),
        ("127.8.9.10", None),
        ("::1", None),
        ("::ffff:127.0.0.1", None),
        ("", "unknown"),
        (None, "unknown"),
        ("x" * 500, "x" * 64),
    ],
)
def test_address_keys(host: str | None, key: str | None) -> None:
    assert address_key(host) == key


def test_the_ipv6_prefix_is_a_setting() -> None:
    assert address_key("2001:db8:1:2::5", 64) == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:ff00::5", 48) == "2001:db8:1::/48"
    limiter = limiter_from_settings(make_settings("sqlite://", rate_limit_ipv6_prefix=48))
    assert limiter.address("2001:db8:1:ff00::5") == "2001:db8:1::/48"
    assert limiter_from_settings(make_settings("sqlite://")).address("2001:db8:1:ff00::5") == (
        "2001:db8:1:ff00::/56"
    )


def test_trusted_proxies_come_from_a_comma_separated_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SWARMGRAD_TRUSTED_PROXIES", "10.0.0.0/8, 192.0.2.1,2001:db8::/32")
    settings = Settings(environment="production", secret_key="k" * 40)
    assert settings.trusted_proxies == ("10.0.0.0/8", "192.0.2.1", "2001:db8::/32")
    monkeypatch.setenv("SWARMGRAD_TRUSTED_PROXIES", "")
    assert Settings(environment="production", secret_key="k" * 40).trusted_proxies == ()
    monkeypatch.setenv("SWARMGRAD_TRUSTED_PROXIES", "10.0.0.1,proxy.example")
    with pytest.raises(ValidationError, match=r"'proxy\.example' is not an IP address"):
        Settings(environment="production", secret_key="k" * 40)


# --------------------------------------------------------------------------- the app


@asynccontextmanager
async def coordinator(tmp_path: Path, **overrides: Any) -> AsyncIterator[FastAPI]:
    settings = make_settings(f"sqlite:///{tmp_path / 'coordinator.db'}", **overrides)
    async with running(create_app(settings)) as app:
        yield app


def client_from(app: FastAPI, host: str = REMOTE) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(host, 1234))
    return httpx.AsyncClient(transport=transport, base_url="http://coordinator")


def loopback(app: FastAPI) -> httpx.AsyncClient:
    return client_from(app, "127.0.0.1")


async def invite(app: FastAPI, max_uses: int = 50) -> tuple[str, str]:
    """A run and an invite to it, made from loopback (never limited)."""
    async with loopback(app) as client:
        api = Api(client)
        run = await api.create_run()
        return run["id"], (await api.create_join_token(run["id"], max_uses=max_uses))["token"]


async def join(app: FastAPI, run_id: str, token: str) -> JoinedPeer:
    async with loopback(app) as client:
        return await Api(client).join(run_id, token)


def assert_limited(response: httpx.Response, max_wait_s: float) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["X-Swarmgrad-Coordinator"] == "1"
    assert re.fullmatch(r"[1-9][0-9]*", response.headers["Retry-After"])
    assert 1 <= int(response.headers["Retry-After"]) <= max_wait_s
    detail = response.json()["detail"]
    assert isinstance(detail, str) and detail.startswith("too many ")


def refused_count(metrics: str, endpoint: str, by: str) -> float:
    found = re.search(
        rf'swarmgrad_process_rate_limited_total\{{[^}}]*by="{by}",endpoint="{endpoint}"'
        rf"[^}}]*\}} ([0-9.e+]+)",
        metrics,
    )
    return float(found.group(1)) if found else 0.0


async def test_join_challenges_are_limited_per_address(tmp_path: Path) -> None:
    async with (
        coordinator(tmp_path, rate_limit_join_burst=3, rate_limit_join_per_s=0.1) as app,
        client_from(app) as remote,
        client_from(app, OTHER_REMOTE) as other,
    ):
        _, token = await invite(app)
        for _ in range(3):
            ok = await remote.post("/api/v1/join/challenge", headers=bearer(token))
            assert ok.status_code == 200, ok.text
        refused = await remote.post("/api/v1/join/challenge", headers=bearer(token))
        assert_limited(refused, max_wait_s=10)
        assert "join challenges" in refused.json()["detail"]
        # unauthenticated attempts count too: the limit comes before the token check
        assert (await remote.post("/api/v1/join/challenge")).status_code == 429
        # another address has its own bucket
        assert (
            await other.post("/api/v1/join/challenge", headers=bearer(token))
        ).status_code == 200
        async with loopback(app) as local:
            for _ in range(10):
                answer = await local.post("/api/v1/join/challenge", headers=bearer(token))
                assert answer.status_code == 200  # loopback is exempt
            metrics = (await local.get("/metrics")).text
        assert refused_count(metrics, "join_challenge", "address") == 2


async def test_joins_are_limited_per_address(tmp_path: Path) -> None:
    async with (
        coordinator(tmp_path, rate_limit_join_burst=1, rate_limit_join_per_s=0.5) as app,
        client_from(app) as remote,
    ):
        run_id, token = await invite(app)
        api = Api(remote)
        await api.join(run_id, token)  # one challenge, one join: each its own bucket
        refused = await remote.post("/api/v1/join/challenge", headers=bearer(token))
        assert_limited(refused, max_wait_s=2)
        refused = await remote.post(f"/api/v1/runs/{run_id}/join", json={}, headers=bearer(token))
        assert_limited(refused, max_wait_s=2)
        assert "joins" in refused.json()["detail"]


async def test_reports_are_limited_per_peer_token_and_counted_against_the_peer(
    tmp_path: Path,
) -> None:
    async with (
        coordinator(
            tmp_path,
            rate_limit_reports_burst=2,
            rate_limit_reports_per_s=0.01,
            # the refusal is recorded for a token this worker verified recently
            peer_auth_cache_ttl_s=60,
        ) as app,
        client_from(app) as remote,
    ):
        run_id, token = await invite(app)
        first, second = await join(app, run_id, token), await join(app, run_id, token)
        api = Api(remote)
        for samples in (10, 20):
            assert (await api.report(run_id, first, samples=samples)).status_code == 202
        refused = await api.report(run_id, first, samples=30)
        assert_limited(refused, max_wait_s=100)
        assert "progress reports from this peer" in refused.json()["detail"]
        # the other peer, from the same address, is not affected
        assert (await api.report(run_id, second, samples=5)).status_code == 202
        # nor is a peer on loopback
        async with loopback(app) as local:
            for samples in range(40, 45):
                assert (await Api(local).report(run_id, first, samples=samples)).status_code == 202
            await app.state.report_buffer.flush()
            peers = (await local.get(f"/api/v1/runs/{run_id}/peers", headers=ORGANIZER)).json()
            metrics = (await local.get("/metrics")).text
        row = next(p for p in peers["peers"] if p["peer_id"] == first.body["peer_id"])
        assert row["reports_refused"] == 1
        assert row["last_refusal"] == "rate_limit:reports"
        assert row["last_refusal_at"] is not None
        other = next(p for p in peers["peers"] if p["peer_id"] == second.body["peer_id"])
        assert other["reports_refused"] == 0
        assert refused_count(metrics, "reports", "peer") == 1


async def test_a_fake_token_cannot_empty_a_peers_bucket(tmp_path: Path) -> None:
    async with (
        coordinator(tmp_path, rate_limit_reports_burst=1, rate_limit_reports_per_s=0.01) as app,
        client_from(app, OTHER_REMOTE) as attacker,
        client_from(app) as remote,
    ):
        run_id, token = await invite(app)
        peer = await join(app, run_id, token)
        # the peer token's id with a wrong secret: a different bucket (and a 401)
        forged = peer.body["peer_token"][:-4] + "AAAA"
        for _ in range(3):
            await attacker.post(
                f"/api/v1/runs/{run_id}/reports",
                json={"epoch": 0, "samples": 0, "samples_per_second": 0.0},
                headers=bearer(forged),
            )
        assert (await Api(remote).report(run_id, peer)).status_code == 202


async def test_bootstrap_and_certificate_renewal_are_limited(tmp_path: Path) -> None:
    async with (
        coordinator(tmp_path, rate_limit_peer_burst=2, rate_limit_peer_per_s=0.05) as app,
        client_from(app) as remote,
    ):
        run_id, token = await invite(app)
        peer = await join(app, run_id, token)
        for path, method in (("bootstrap", "GET"), ("certificate", "POST")):
            url = f"/api/v1/runs/{run_id}/{path}"
            for _ in range(2):
                answer = await remote.request(method, url, headers=peer.headers)
                assert answer.status_code == 200, answer.text
            refused = await remote.request(method, url, headers=peer.headers)
            assert_limited(refused, max_wait_s=20)


async def test_peer_endpoints_are_also_limited_per_address(tmp_path: Path) -> None:
    async with (
        coordinator(tmp_path, rate_limit_address_burst=3, rate_limit_address_per_s=0.1) as app,
        client_from(app) as remote,
        client_from(app, OTHER_REMOTE) as other,
    ):
        run_id, token = await invite(app)
        peers = [await join(app, run_id, token) for _ in range(4)]
        url = f"/api/v1/runs/{run_id}/bootstrap"
        for peer in peers[:3]:
            assert (await remote.get(url, headers=peer.headers)).status_code == 200
        refused = await remote.get(url, headers=peers[3].headers)
        assert_limited(refused, max_wait_s=10)
        assert "from this address" in refused.json()["detail"]
        assert (await other.get(url, headers=peers[3].headers)).status_code == 200


async def test_ipv6_clients_are_counted_per_56(tmp_path: Path) -> None:
    async with coordinator(tmp_path, rate_limit_join_burst=2, rate_limit_join_per_s=0.1) as app:
        _, token = await invite(app)

        async def challenge(host: str) -> int:
            async with client_from(app, host) as client:
                answer = await client.post("/api/v1/join/challenge", headers=bearer(token))
                return answer.status_code

        assert await challenge("2001:db8:1:2::1") == 200
        assert await challenge("2001:db8:1:2:aaaa:bbbb:cccc:dddd") == 200
        assert await challenge("2001:db8:1:2::ffff") == 429  # the same /64
        assert await challenge("2001:db8:1:3::1") == 429  # another /64 of the same /56
        assert await challenge("2001:db8:1:100::1") == 200  # another /56


async def test_x_forwarded_for_counts_only_from_a_trusted_proxy(tmp_path: Path) -> None:
    proxy = "192.0.2.10"
    async with (
        coordinator(
            tmp_path,
            rate_limit_join_burst=1,
            rate_limit_join_per_s=0.1,
            trusted_proxies=("192.0.2.0/28",),
        ) as app,
        client_from(app, proxy) as via_proxy,
        client_from(app) as direct,
    ):
        _, token = await invite(app)

        def forwarded(chain: str) -> dict[str, str]:
            return {**bearer(token), "X-Forwarded-For": chain}

        path = "/api/v1/join/challenge"
        # through the proxy, each forwarded client has its own bucket
        assert (await via_proxy.post(path, headers=forwarded("198.51.100.1"))).status_code == 200
        assert (await via_proxy.post(path, headers=forwarded("198.51.100.1"))).status_code == 429
        assert (await via_proxy.post(path, headers=forwarded("198.51.100.2"))).status_code == 200
        # a client cannot pass as another by prepending to the header: the rightmost
        # address the proxy did not vouch for is the client
        spoofed = forwarded("198.51.100.99, 198.51.100.1")
        assert (await via_proxy.post(path, headers=spoofed)).status_code == 429
        # nor, from anywhere else, by sending the header at all (even naming loopback)
        assert (await direct.post(path, headers=forwarded("198.51.100.3"))).status_code == 200
        for chain in ("198.51.100.4", "127.0.0.1"):
            assert (await direct.post(path, headers=forwarded(chain))).status_code == 429


async def test_limits_can_be_switched_off(tmp_path: Path) -> None:
    async with (
        coordinator(
            tmp_path,
            rate_limits=False,
            rate_limit_join_burst=1,
            rate_limit_reports_burst=1,
            rate_limit_peer_burst=1,
        ) as app,
        client_from(app) as remote,
    ):
        run_id, token = await invite(app)
        api = Api(remote)
        calls: list[Callable[[], Any]] = []
        for _ in range(3):
            peer = await api.join(run_id, token)
            calls = [
                lambda peer=peer: api.report(run_id, peer),
                lambda peer=peer: remote.get(
                    f"/api/v1/runs/{run_id}/bootstrap", headers=peer.headers
                ),
                lambda peer=peer: remote.post(
                    f"/api/v1/runs/{run_id}/certificate", headers=peer.headers
                ),
            ]
            for call in calls * 2:
                assert (await call()).status_code in (200, 202)
        metrics = (await remote.get("/metrics")).text
        assert "swarmgrad_process_rate_limited_total{" not in metrics
