"""Settings validation and Prometheus metrics."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from server.app import create_app
from server.config import Settings
from server.security import KeyBox, PrincipalCache
from tests.server.conftest import ORGANIZER, Api, client_for, make_settings, running


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("secret", [None, "changethis", "short", "secret"])
def test_production_refuses_missing_or_placeholder_secrets(
    secret: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWARMGRAD_SECRET_KEY", raising=False)
    values: dict[str, Any] = {"environment": "production"}
    if secret is not None:
        values["secret_key"] = secret
    with pytest.raises(
        ValidationError, match=r"refusing to start in production.*SWARMGRAD_SECRET_KEY"
    ):
        Settings(**values)


def test_production_refuses_a_placeholder_admin_token() -> None:
    with pytest.raises(ValidationError, match="SWARMGRAD_ADMIN_TOKEN"):
        Settings(environment="production", secret_key="k" * 40, admin_token="changethis")


def test_development_warns_instead() -> None:
    with pytest.warns(UserWarning, match=r"SWARMGRAD_SECRET_KEY.*development"):
        settings = Settings(environment="development", secret_key="changethis")
    assert settings.environment == "development"


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMGRAD_SECRET_KEY", "e" * 40)
    monkeypatch.setenv("SWARMGRAD_DATABASE_URL", "sqlite:///elsewhere.db")
    monkeypatch.setenv("SWARMGRAD_PEER_ONLINE_TTL_S", "12.5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings = Settings(environment="production")
    assert settings.database_url == "sqlite:///elsewhere.db"
    assert settings.peer_online_ttl_s == 12.5
    assert "eeee" not in repr(settings)  # secrets stay out of reprs and logs


def test_keybox_binds_ciphertexts_to_the_secret_and_the_run() -> None:
    box = KeyBox("a" * 40)
    sealed = box.seal(b"private key bytes", b"run-1")
    assert b"private key bytes" not in sealed
    assert box.open(sealed, b"run-1") == b"private key bytes"
    with pytest.raises(ValueError, match="SWARMGRAD_SECRET_KEY differs"):
        KeyBox("b" * 40).open(sealed, b"run-1")
    with pytest.raises(ValueError):
        box.open(sealed, b"run-2")


async def test_metrics_reflect_the_database(
    app: FastAPI, api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run()
    paused = await api.create_run("paused")
    await client.patch(
        f"/api/v1/runs/{paused['id']}",
        json={"status": "paused"},
        headers={"Authorization": f"Bearer {app.state.settings.admin_token.get_secret_value()}"},
    )
    token = (await api.create_join_token(run["id"]))["token"]
    peers = [await api.join(run["id"], token) for _ in range(3)]
    for i, peer in enumerate(peers):
        assert (
            await api.report(run["id"], peer, samples=100 * (i + 1), samples_per_second=2.0)
        ).status_code == 202
    await app.state.report_buffer.flush()

    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = _samples(response.text)
    rid = (("run_id", run["id"]),)
    assert samples[("swarmgrad_runs", (("status", "running"),))] == 1
    assert samples[("swarmgrad_runs", (("status", "paused"),))] == 1
    assert samples[("swarmgrad_peers", rid)] == 3
    assert samples[("swarmgrad_peers_online", rid)] == 3
    assert samples[("swarmgrad_samples_total", rid)] == 600
    assert samples[("swarmgrad_samples_per_second", rid)] == 6.0
    assert samples[("swarmgrad_reports_total", rid)] == 3
    written = [
        v for (name, _), v in samples.items() if name == "swarmgrad_process_reports_written_total"
    ]
    assert written == [3]
    requests = {
        dict(labels)["route"]
        for (name, labels), _ in samples.items()
        if name == "swarmgrad_http_requests_total"
    }
    assert "/api/v1/runs/{run_id}/reports" in requests  # templates, not raw paths
    assert not any(run["id"] in route for route in requests)
    assert any(name == "swarmgrad_http_request_duration_seconds_bucket" for name, _ in samples)


def test_principal_cache_needs_the_secret_and_expires() -> None:
    now = [100.0]
    cache = PrincipalCache(ttl_s=5, max_entries=10, clock=lambda: now[0])
    cache.put("id1", "secret", "principal")
    assert cache.get("id1", "secret") == "principal"
    assert cache.get("id1", "Secret") is None
    assert cache.get("id2", "secret") is None
    now[0] += 5.5
    assert cache.get("id1", "secret") is None
    for i in range(25):
        cache.put(f"k{i}", "s", i)
    assert cache.get("k24", "s") == 24 and cache.get("k0", "s") is None
    assert PrincipalCache(ttl_s=0).get("id1", "secret") is None


async def test_report_path_reuses_verified_peers_for_the_ttl(database_url: str) -> None:
    settings = make_settings(database_url, peer_auth_cache_ttl_s=3600, peer_auth_recheck_s=3600)
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run = await api.create_run()
        token = (await api.create_join_token(run["id"]))["token"]
        peer = await api.join(run["id"], token)
        late = await api.join(run["id"], token)
        assert (await api.report(run["id"], peer)).status_code == 202  # verified and cached
        await app.state.revocation_sweep.warmed()  # the run's other tokens, read in the background
        await client.patch(
            f"/api/v1/runs/{run['id']}", json={"status": "finished"}, headers=ORGANIZER
        )
        # Until its next look at the database (PEER_AUTH_RECHECK_S) this worker still takes
        # the cached peers' reports: the one it verified, and the run's others, which it
        # read in one query once it met the run...
        assert (await api.report(run["id"], peer)).status_code == 202
        assert (await api.report(run["id"], late)).status_code == 202
        # ...and after it, the database's answer.
        await asyncio.to_thread(app.state.revocation_sweep.sweep_once)
        for each in (peer, late):
            assert (await api.report(run["id"], each)).status_code == 409
        # Another run's path never matches a cached principal.
        other = await api.create_run("other")
        assert (await api.report(other["id"], peer)).status_code == 403
