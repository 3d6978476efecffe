"""The report path's cache of verified peer tokens keeps them long, yet honours what the
database revokes: every ``peer_auth_recheck_s`` a worker forgets the tokens revoked and those
of runs finished since it last looked, and it never keeps a token past its expiry
(SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio

from sqlalchemy import update

from server.app import create_app
from server.models import Token, utcnow
from server.security import PrincipalCache, parse_token
from tests.server.conftest import ORGANIZER, Api, client_for, make_settings, running


def test_the_cache_never_keeps_a_token_past_its_expiry_and_forgets_on_demand() -> None:
    now = [0.0]
    cache = PrincipalCache(ttl_s=600, clock=lambda: now[0])
    cache.put("a", "s", "A", run_id="r1", expires_in_s=5)
    cache.put("b", "s", "B", run_id="r1")
    cache.put("c", "s", "C", run_id="r2")
    now[0] = 6
    assert cache.get("a", "s") is None  # its token expired: not kept for the TTL
    assert cache.get("b", "s") == "B"
    assert cache.evict_run("r1") == 1 and cache.get("b", "s") is None
    assert cache.evict(["c", "unknown"]) == 1 and cache.get("c", "s") is None
    assert len(cache) == 0


async def test_revoked_tokens_and_finished_runs_are_forgotten_at_the_next_sweep(
    database_url: str,
) -> None:
    settings = make_settings(database_url, peer_auth_cache_ttl_s=3600, peer_auth_recheck_s=3600)
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run = await api.create_run()
        invite = (await api.create_join_token(run["id"], max_uses=3))["token"]
        banned = await api.join(run["id"], invite, display_name="mallory")
        other = await api.join(run["id"], invite, display_name="ada")
        for peer in (banned, other):
            assert (await api.report(run["id"], peer)).status_code == 202  # cached
        sweep = app.state.revocation_sweep
        assert await asyncio.to_thread(sweep.sweep_once) == 0  # nothing revoked yet

        volunteers = (await client.get(f"/api/v1/runs/{run['id']}/volunteers?q=mallory")).json()
        ban = await client.post(
            f"/api/v1/runs/{run['id']}/volunteers/{volunteers['volunteers'][0]['id']}/ban",
            headers=ORGANIZER,
        )
        assert ban.status_code == 200, ban.text
        # Until the sweep, this worker still takes the cached token (within
        # peer_auth_recheck_s); after it, the database's answer.
        assert (await api.report(run["id"], banned)).status_code == 202
        assert await asyncio.to_thread(sweep.sweep_once) == 1
        assert (await api.report(run["id"], banned)).status_code == 401
        assert (await api.report(run["id"], other)).status_code == 202

        finished = await client.patch(
            f"/api/v1/runs/{run['id']}", json={"status": "finished"}, headers=ORGANIZER
        )
        assert finished.status_code == 200
        assert await asyncio.to_thread(sweep.sweep_once) == 1  # ada's token, of that run
        assert (await api.report(run["id"], other)).status_code == 409


async def test_a_run_met_once_is_warmed_in_one_query_and_still_needs_each_secret(
    database_url: str,
) -> None:
    settings = make_settings(database_url, peer_auth_cache_ttl_s=3600, peer_auth_recheck_s=3600)
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run = await api.create_run()
        invite = (await api.create_join_token(run["id"], max_uses=3))["token"]
        first, second, revoked = [await api.join(run["id"], invite) for _ in range(3)]
        gone, parsed = (parse_token(p.body["peer_token"]) for p in (revoked, second))
        assert gone is not None and parsed is not None
        with app.state.session_factory() as session, session.begin():
            session.execute(update(Token).where(Token.id == gone.id).values(revoked_at=utcnow()))
        cache = app.state.principal_cache
        assert (await api.report(run["id"], first)).status_code == 202  # verified alone
        await asyncio.gather(*app.state.revocation_sweep._warming.values())  # then the run
        assert len(cache) == 2  # first's and second's tokens; the revoked one is not kept
        assert cache.get(parsed.id, parsed.secret) is not None
        assert cache.get(parsed.id, parsed.secret + "x") is None  # the secret still counts
        peer_pk = cache.get(parsed.id, parsed.secret).peer_pk
        assert peer_pk in app.state.report_guard._tracks  # the bounds' track, for the fast path
        assert (await api.report(run["id"], second)).status_code == 202
        assert (await api.report(run["id"], revoked)).status_code == 401
