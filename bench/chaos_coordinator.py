"""Chaos for the coordinator, at a larger scale than its tests (``python bench/chaos.py
--coordinator``): the database's storage failing under reporting volunteers, and hostile
volunteers among honest ones. The scenarios are those of tests/server/test_chaos_storage.py
and test_chaos_hostile.py, built from the same helpers; the app runs in this process
(ASGI), so that its pool can be emptied to remount the filesystem read-only.

Prints "reports acknowledged / reports stored" for each storage failure (SQLite on a full,
then read-only tmpfs — needs root; PostgreSQL cut off — needs the test server) and
"attacks tried / admitted" for the hostile volunteers, with the honest totals checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from server.app import create_app
from server.services.report_bounds import SAMPLES_GRACE_S
from swarmlab.node_process import wait_until
from tests.server.conftest import ORGANIZER, Api, make_settings, running
from tests.server.test_chaos_storage import (
    Swarm,
    cut_off,
    fill,
    remount_read_only,
    restore,
    separate_postgres_database,
    small_filesystem,
    stored,
)
from tests.server.test_rate_limits import client_from, loopback


async def _swarm(app: Any, client: Any, volunteers: int) -> Swarm:
    api = Api(client)
    run = await api.create_run()
    invite = (await api.create_join_token(run["id"], max_uses=volunteers))["token"]
    peers = [await api.join(run["id"], invite) for _ in range(volunteers)]
    swarm = Swarm(api, run["id"], peers)
    await swarm.report(1)
    await app.state.report_buffer.flush()
    return swarm


async def _settle(app: Any, swarm: Swarm, timeout: float = 60.0) -> tuple[int, float]:
    """Wait for every acknowledged report to be stored; (stored, seconds it took)."""
    start = time.monotonic()
    await asyncio.to_thread(wait_until, lambda: stored(app) == swarm.acknowledged, timeout)
    return stored(app), time.monotonic() - start


async def sqlite_storage(volunteers: int, rounds: int, out: Any) -> None:
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        try:
            disk = stack.enter_context(small_filesystem(root / "db", "16m"))
        except pytest.fail.Exception as error:
            print(f"SQLite on a full disk: skipped ({error})", file=out)
            return
        settings = make_settings(
            f"sqlite:///{disk / 'coordinator.db'}",
            spill_dir=root / "spill",
            peer_auth_cache_ttl_s=3600,
        )
        async with running(create_app(settings)) as app, loopback(app) as client:
            swarm = await _swarm(app, client, volunteers)
            fill(disk)
            await swarm.report(rounds)
            remount_read_only(app, disk)
            await swarm.report(rounds)
            restore(disk)
            done, took = await _settle(app, swarm)
        print(
            f"SQLite, disk full then read-only, {volunteers} volunteers: reports "
            f"acknowledged / stored {swarm.acknowledged} / {done} "
            f"({took:.1f} s after space returned)",
            file=out,
        )


async def postgres_outage(volunteers: int, rounds: int, out: Any) -> None:
    try:
        database = separate_postgres_database()
        url, admin = database.__enter__()
    except pytest.skip.Exception as error:
        print(f"PostgreSQL cut off: skipped ({error})", file=out)
        return
    try:
        name = make_url(url).database or ""
        with tempfile.TemporaryDirectory() as directory:
            settings = make_settings(
                url, spill_dir=Path(directory) / "spill", peer_auth_cache_ttl_s=3600
            )
            async with running(create_app(settings)) as app, loopback(app) as client:
                swarm = await _swarm(app, client, volunteers)
                cut_off(admin, name, allow=False)
                try:
                    await swarm.report(rounds)
                finally:
                    cut_off(admin, name, allow=True)
                done, took = await _settle(app, swarm)
                print(
                    f"PostgreSQL cut off, {volunteers} volunteers: reports acknowledged / "
                    f"stored {swarm.acknowledged} / {done} ({took:.1f} s after it returned)",
                    file=out,
                )
    finally:
        database.__exit__(None, None, None)


async def hostile(honest: int, offenders: int, rounds: int, out: Any) -> None:
    """``offenders`` volunteers, each at an address of its own, try every trick of
    test_chaos_hostile.py for ``rounds`` rounds among ``honest`` honest ones, then flood."""
    max_rate, lead = 100.0, 2
    with tempfile.TemporaryDirectory() as directory:
        settings = make_settings(
            f"sqlite:///{Path(directory) / 'coordinator.db'}",
            peer_auth_cache_ttl_s=3600,
            report_max_samples_per_second=max_rate,
            report_max_epoch_lead=lead,
            rate_limit_reports_per_s=0.5,
            rate_limit_reports_burst=10 * rounds,
            rate_limit_join_per_s=0.5,
            rate_limit_join_burst=5,
        )
        async with running(create_app(settings)) as app, loopback(app) as organizer:
            run = await Api(organizer).create_run()
            run_id = run["id"]
            invite = (await Api(organizer).create_join_token(run_id, max_uses=10_000))["token"]
            hosts = [f"203.0.113.{i + 1}" for i in range(honest)]
            hosts += [f"198.51.100.{i + 1}" for i in range(offenders)]
            clients = [client_from(app, host) for host in hosts]
            try:
                apis = [Api(c) for c in clients]
                peers = [await api.join(run_id, invite) for api in apis]
                tried, admitted, honest_refused = Counter[str](), Counter[str](), 0
                for round_ in range(rounds):
                    epoch = round_ // 4
                    for api, peer in zip(apis[:honest], peers[:honest], strict=True):
                        answer = await api.report(
                            run_id, peer, epoch=epoch, samples=(round_ + 1) * 50,
                            samples_per_second=10.0,
                        )  # fmt: skip
                        honest_refused += answer.status_code != 202
                    for api, peer in zip(apis[honest:], peers[honest:], strict=True):
                        # A reset: the first few are within the bound; those that take the
                        # total past it are attacks.
                        await api.report(
                            run_id, peer, epoch=epoch, samples=int(max_rate * SAMPLES_GRACE_S * 0.9)
                        )
                        await api.report(run_id, peer, epoch=epoch, samples=0)
                        for kind, body in (
                            ("absurd samples", {"samples": 10**15}),
                            ("absurd rate", {"samples_per_second": 1e12}),
                            ("absurd epoch", {"epoch": 10**9}),
                            ("epoch past the lead", {"epoch": epoch + lead + 1}),
                        ):
                            tried[kind] += 1
                            answer = await api.report(run_id, peer, **{"epoch": epoch, **body})
                            admitted[kind] += answer.status_code == 202
                floods = Counter[str]()
                for api, peer in zip(apis[honest:], peers[honest:], strict=True):
                    for _ in range(10 * rounds):  # the burst again: past what is left of it
                        answer = await api.report(run_id, peer, epoch=0, samples=0)
                        floods["reports refused"] += answer.status_code == 429
                    for _ in range(50):
                        answer = await api.client.post(
                            "/api/v1/join/challenge", headers={"Authorization": f"Bearer {invite}"}
                        )
                        floods["joins refused"] += answer.status_code == 429
            finally:
                for client in clients:
                    await client.aclose()
            await app.state.report_buffer.flush()
            listed = (
                await organizer.get(f"/api/v1/runs/{run_id}/peers", headers=ORGANIZER)
            ).json()["peers"]
        by_id = {p["peer_id"]: p for p in listed}
        exact = sum(by_id[p.body["peer_id"]]["samples"] == rounds * 50 for p in peers[:honest])
        cap = max_rate * (SAMPLES_GRACE_S + 600)
        within = sum(by_id[p.body["peer_id"]]["samples"] <= cap for p in peers[honest:])
        refusals = sum(by_id[p.body["peer_id"]]["reports_refused"] for p in peers[honest:])
    print(
        f"Hostile volunteers: {offenders} among {honest} honest, {rounds} rounds; attacks "
        f"tried / admitted {sum(tried.values())} / {sum(admitted.values())}",
        file=out,
    )
    for kind in tried:
        print(f"  {kind}: {tried[kind]} / {admitted[kind]}", file=out)
    print(
        f"  floods: reports {offenders * 10 * rounds} sent, {floods['reports refused']} "
        f"refused (429; the rest is what the burst of {10 * rounds} had left, {6 * rounds} "
        f"being used by the rounds); joins {offenders * 50} sent, {floods['joins refused']} "
        f"refused (429; burst 5 per address)",
        file=out,
    )
    print(
        f"  honest totals exact: {exact} / {honest} (honest reports refused: "
        f"{honest_refused}); offenders within the samples bound: {within} / {offenders}; "
        f"refusals counted against the offenders: {refusals}",
        file=out,
    )


def run(out: Any) -> None:
    asyncio.run(sqlite_storage(volunteers=50, rounds=20, out=out))
    asyncio.run(postgres_outage(volunteers=50, rounds=20, out=out))
    asyncio.run(hostile(honest=20, offenders=5, rounds=20, out=out))
