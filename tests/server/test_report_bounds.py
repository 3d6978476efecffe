"""Plausibility bounds on reports: the pure rules, then through the API on both databases —
a hostile peer's resets and absurd claims are refused, counted, and change nobody's totals."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from server.app import create_app
from server.clock import now_ms
from server.config import Settings
from server.models import Peer
from server.services.credit_rates import CREDIT_GRACE_S
from server.services.report_bounds import (
    Bound,
    PeerTrack,
    ReportLimits,
    SwarmView,
    check,
    lift_on_refusal,
    swarm_epoch,
)
from server.services.reports import PendingReport, write_reports
from tests.server.conftest import ORGANIZER, Api, JoinedPeer, client_for, make_settings, running

LIMITS = ReportLimits(max_samples_per_second=1000.0, max_epoch_lead=5)


def _check(track: PeerTrack, view: SwarmView | None = None, **report: Any) -> Bound | None:
    fields = {"epoch": 0, "samples": 0, "samples_per_second": 0.0, "now_ms": 0, **report}
    refusal = check(LIMITS, track, view, **fields)
    return None if refusal is None else refusal.bound


def test_resets_bank_at_most_what_the_rate_allows_since_joining() -> None:
    track = PeerTrack(first_seen_ms=0, volunteer_id=1, banked=0, samples=0, as_of_ms=None)
    cap = LIMITS.samples_cap(0, 10_000)  # 1000/s for 10 s plus the grace
    assert cap == 70_000
    accepted = 0
    for i in range(1000):  # counter up to 40,000, back to zero, and again
        samples = 40_000 if i % 2 == 0 else 0
        if _check(track, samples=samples, now_ms=10_000) is None:
            track = track.after(samples, 10_000)
            accepted += 1
        else:
            assert _check(track, samples=samples, now_ms=10_000) is Bound.samples
    assert track.contribution_after(track.samples) <= cap
    # The first 40,000 and every 0 (the first a reset); any later 40,000 would pass the cap.
    assert accepted == 501 and track.contribution_after(0) == 40_000


def test_rate_and_epoch_bounds() -> None:
    track = PeerTrack(first_seen_ms=0, volunteer_id=1, banked=0, samples=0, as_of_ms=None)
    assert _check(track, samples_per_second=1000.0) is None
    assert _check(track, samples_per_second=1000.5) is Bound.samples_per_second
    view = SwarmView(read_ms=0, online={2: 10, 3: 12}, highest=12)
    assert _check(track, view, epoch=17) is None
    assert _check(track, view, epoch=18) is Bound.epoch
    assert _check(track, None, epoch=10**9) is None  # no view (database down): not judged


def test_the_swarm_epoch_never_counts_the_reporters_own_volunteer_when_others_can() -> None:
    view = SwarmView(read_ms=0, online={1: 1000, 2: 10, 3: 12}, highest=1000)
    assert swarm_epoch(view, volunteer_id=1) == 12  # two others: their highest
    assert swarm_epoch(view, volunteer_id=2) == 1000  # the others include the liar: looser
    # One laggard alone cannot hold the front back: without two others, the run's highest.
    assert swarm_epoch(SwarmView(0, {1: 500, 2: 0}, 500), volunteer_id=1) == 500


TTL_MS = 60_000  # the online TTL the views below are carried with


def _refreshed(older: SwarmView, online: dict[int, int], highest: int, at_ms: int) -> SwarmView:
    """What a worker's refresh makes of ``older`` when the database still holds ``online``
    and ``highest`` (refused reports are never stored): a new view carrying the old one's."""
    view = SwarmView(read_ms=at_ms, online=dict(online), highest=highest)
    view.carry(older, at_ms - TTL_MS)
    return view


def _report(limits: ReportLimits, view: SwarmView, volunteer_id: int, epoch: int, at: int) -> bool:
    """One report judged as the guard does: accepted (seen), or refused (lifted at most once
    per view). Whether it was accepted."""
    track = PeerTrack(0, volunteer_id, banked=0, samples=0, as_of_ms=None)
    refusal = check(limits, track, view, epoch=epoch, samples=0, samples_per_second=0, now_ms=at)
    if refusal is None:
        view.saw(volunteer_id, epoch, at)
        return True
    assert refusal.bound is Bound.epoch
    lift_on_refusal(limits, view, volunteer_id, epoch, at)
    return False


def test_a_lone_volunteer_that_ran_ahead_is_back_in_within_a_few_refreshes() -> None:
    """Its first report (epoch 0) stored, then 220 epochs alone: refused at first, as before,
    but every refresh lets the bound climb by the lead, so it is not locked out for good."""
    limits = ReportLimits(max_samples_per_second=1000.0, max_epoch_lead=100)
    stored = {1: 0}
    view = SwarmView(read_ms=0, online=dict(stored), highest=0)
    assert not _report(limits, view, 1, 220, 0)
    allowed = []
    for refresh in range(1, math.ceil(220 / 100) + 2):
        at = refresh * 5_000
        view = _refreshed(view, stored, 0, at)
        allowed.append(swarm_epoch(view, 1) + 100)
        if any(_report(limits, view, 1, 220, at) for _ in range(5)):
            break
    else:
        pytest.fail(f"still refused after {refresh} refreshes; bounds {allowed}")
    assert allowed == [200, 300]  # the lead per refresh, however many reports were refused
    assert refresh <= math.ceil(220 / 100) + 1


def test_volunteers_that_trained_apart_lift_each_other_back_in() -> None:
    """Two (or three) volunteers each 220 epochs past the stored 0 count each other's lifts
    (100, then 200): all are back in on one view, without waiting for a refresh."""
    limits = ReportLimits(max_samples_per_second=1000.0, max_epoch_lead=100)
    for volunteers, first_round in [([1, 2], [False, False]), ([1, 2, 3], [False, False, True])]:
        view = SwarmView(read_ms=0, online=dict.fromkeys(volunteers, 0), highest=0)
        assert [_report(limits, view, v, 220, 1) for v in volunteers] == first_round
        assert all(_report(limits, view, v, 220, 2) for v in volunteers)


def test_a_liar_among_two_honest_volunteers_stays_where_they_allow() -> None:
    """Claiming 10**6 over and over through many refreshes: refused every time, its bound
    never moves past the honest epochs plus the lead, and its recorded epoch gains at most
    the lead per refresh (here: none after the first)."""
    limits = ReportLimits(max_samples_per_second=1000.0, max_epoch_lead=100)
    stored = {2: 10, 3: 12}
    view = SwarmView(read_ms=0, online=dict(stored), highest=12)
    recorded = [12]  # where the swarm was: the liar has nothing stored
    for refresh in range(20):
        at = refresh * 5_000
        if refresh:
            view = _refreshed(view, stored, 12, at)
        for _ in range(10):
            assert not _report(limits, view, 1, 10**6, at)
        assert swarm_epoch(view, 1) + 100 == 112  # only the others' epochs count for it
        assert not _report(limits, view, 1, 113, at) and _report(limits, view, 1, 112, at)
        recorded.append(view.online[1])
        assert recorded[-1] - recorded[-2] <= 100
    assert max(recorded) == 112
    # Its lift counts for the honest volunteers (a looser bound for them, nothing for it).
    assert swarm_epoch(view, 2) == 112


def test_a_volunteer_is_lifted_at_most_once_per_view() -> None:
    limits = ReportLimits(max_samples_per_second=1000.0, max_epoch_lead=5)
    view = SwarmView(read_ms=0, online={1: 0, 2: 0}, highest=0)
    assert lift_on_refusal(limits, view, 1, 10**6, 1) == 5
    assert [lift_on_refusal(limits, view, 1, 10**6, t) for t in range(2, 100)] == [None] * 98
    assert view.online == {1: 5, 2: 0} and view.lifted == {1: (5, 1)}
    # Another volunteer's lift in the same view counts for the first one's bound, but not
    # a second lift of the first: it waits for the next view.
    assert lift_on_refusal(limits, view, 2, 10**6, 2) == 10
    assert lift_on_refusal(limits, view, 1, 10**6, 3) is None
    # The next view carries both lifts (as reached by the run) and lifts each once more.
    later = _refreshed(view, {1: 0, 2: 0}, 0, 5_000)
    assert (later.online, later.highest, later.lifted_here) == ({1: 5, 2: 10}, 10, set())
    assert lift_on_refusal(limits, later, 1, 10**6, 5_001) == 15
    assert lift_on_refusal(limits, later, 1, 10**6, 5_002) is None
    # A lift older than the online TTL, or one the database has caught up with, is dropped.
    assert _refreshed(later, {}, 0, 5_000 + TTL_MS + 1).lifted == {1: (15, 5_001)}
    assert _refreshed(later, {1: 15, 2: 3}, 15, 5_002).lifted == {2: (10, 2)}


@pytest.fixture
def bounded_settings(database_url: str) -> Settings:
    return make_settings(
        database_url,
        report_max_samples_per_second=1000.0,
        report_max_epoch_lead=5,
        report_swarm_refresh_s=1e-3,  # every refusal looks at the database again
    )


@pytest.fixture
async def bounded(bounded_settings: Settings) -> AsyncIterator[tuple[FastAPI, Api]]:
    async with running(create_app(bounded_settings)) as app, client_for(app) as client:
        yield app, Api(client)


async def _peers(client: httpx.AsyncClient, run_id: str) -> dict[str, dict[str, Any]]:
    listed = await client.get(f"/api/v1/runs/{run_id}/peers", headers=ORGANIZER)
    return {p["peer_id"]: p for p in listed.json()["peers"]}


async def _progress(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    return (await client.get(f"/api/v1/runs/{run_id}/progress")).json()


async def _swarm(api: Api) -> tuple[dict[str, Any], list[JoinedPeer], JoinedPeer]:
    """A run with two honest peers at epoch 5 (each its own volunteer) and a hostile one."""
    run = await api.create_run()
    invite = (await api.create_join_token(run["id"]))["token"]
    honest = [await api.join(run["id"], invite) for _ in range(2)]
    hostile = await api.join(run["id"], invite)
    for peer in honest:
        reply = await api.report(run["id"], peer, epoch=5, samples=100, samples_per_second=50)
        assert reply.status_code == 202, reply.text
    return run, honest, hostile


async def test_a_thousand_counter_resets_neither_break_ingestion_nor_pin_the_epoch(
    bounded: tuple[FastAPI, Api],
) -> None:
    app, api = bounded
    run, honest, hostile = await _swarm(api)
    statuses = []
    bodies = [  # up, reset, up with an absurd epoch, stay
        {"samples": 50_000, "epoch": 10},
        {"samples": 0, "epoch": 10},
        {"samples": 50_000, "epoch": 2**53},
        {"samples": 0, "epoch": 10},
    ]
    for i in range(1000):
        body = bodies[i % 4]
        statuses.append((await api.report(run["id"], hostile, **body)).status_code)
        if i % 100 == 0:  # the honest peers keep reporting meanwhile
            for peer in honest:
                reply = await api.report(run["id"], peer, epoch=6, samples=100 + i)
                assert reply.status_code == 202, reply.text
            await app.state.report_buffer.flush()
    assert set(statuses) == {202, 422}
    await app.state.report_buffer.flush()

    progress = await _progress(api.client, run["id"])
    assert progress["epoch"] == 10  # at most the lead past the honest peers
    peers = await _peers(api.client, run["id"])
    for peer in honest:
        assert peers[peer.body["peer_id"]]["samples"] == 1000  # their latest counters
    mine = peers[hostile.body["peer_id"]]
    assert mine["reports_refused"] == statuses.count(422) >= 490
    assert mine["last_refusal"] in {"epoch", "samples"}
    with app.state.session_factory() as session:
        row = session.scalars(select(Peer).where(Peer.peer_id == hostile.body["peer_id"])).one()
        # one climb, credited at most at the limit since it joined plus the credit grace
        cap = 1000 * ((now_ms() - row.first_seen_ms) / 1000 + CREDIT_GRACE_S)
        assert 0 < mine["samples"] == row.samples_base + row.samples <= min(cap, 50_000)
    assert progress["samples"] == 2 * 1000 + mine["samples"]


async def test_absurd_rates_samples_and_epochs_are_422_and_counted(
    bounded: tuple[FastAPI, Api],
) -> None:
    app, api = bounded
    run, honest, hostile = await _swarm(api)
    for body, bound in [
        ({"samples_per_second": 1e9}, "samples_per_second"),
        ({"samples": 10**15}, "samples"),
        ({"epoch": 10**6}, "epoch"),
    ]:
        reply = await api.report(run["id"], hostile, **body)
        assert reply.status_code == 422, reply.text
        assert reply.json()["detail"].startswith(bound), reply.json()
    assert (await api.report(run["id"], hostile, epoch=7, samples=7)).status_code == 202
    await app.state.report_buffer.flush()
    peers = await _peers(api.client, run["id"])
    mine = peers[hostile.body["peer_id"]]
    assert (mine["reports_refused"], mine["last_refusal"]) == (3, "epoch")
    assert mine["last_refusal_at"] is not None
    assert all(peers[p.body["peer_id"]]["reports_refused"] == 0 for p in honest)
    progress = await _progress(api.client, run["id"])
    assert (progress["samples"], progress["epoch"]) == (207, 7)


async def test_the_fast_path_refuses_as_the_route_does(bounded_settings: Settings) -> None:
    """With the token cached, a report within bounds never reaches the route; one past them
    is handed to it and refused there, once."""
    settings = bounded_settings.model_copy(update={"peer_auth_cache_ttl_s": 3600.0})
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run, _, hostile = await _swarm(api)
        assert (await api.report(run["id"], hostile, epoch=9, samples=1)).status_code == 202
        for _ in range(3):
            assert (await api.report(run["id"], hostile, epoch=99)).status_code == 422
        assert (await api.report(run["id"], hostile, epoch=10, samples=2)).status_code == 202
        await app.state.report_buffer.flush()
        mine = (await _peers(client, run["id"]))[hostile.body["peer_id"]]
        assert (mine["reports_refused"], mine["samples"], mine["epoch"]) == (3, 2, 10)


async def test_a_lone_volunteer_may_lead_a_laggard(bounded: tuple[FastAPI, Api]) -> None:
    """Without two other volunteers there is no majority: the run's highest epoch counts,
    so one stuck far behind does not hold the front back."""
    app, api = bounded
    run = await api.create_run()
    invite = (await api.create_join_token(run["id"]))["token"]
    front, laggard = await api.join(run["id"], invite), await api.join(run["id"], invite)
    for epoch in range(0, 30, 5):
        assert (await api.report(run["id"], front, epoch=epoch)).status_code == 202
        await app.state.report_buffer.flush()
    assert (await api.report(run["id"], laggard, epoch=0)).status_code == 202
    await app.state.report_buffer.flush()
    assert (await api.report(run["id"], front, epoch=30)).status_code == 202


async def test_the_write_clamps_banked_samples_whatever_a_worker_saw(
    bounded: tuple[FastAPI, Api],
) -> None:
    """Workers judge with what they saw; the write holds each peer to its cap regardless,
    so even a thousand resets admitted by stale workers cannot overflow a column."""
    app, api = bounded
    run, honest, hostile = await _swarm(api)
    await app.state.report_buffer.flush()
    factory = app.state.session_factory
    with factory() as session:
        pks = {
            p.peer_id: p.id
            for p in session.scalars(select(Peer).where(Peer.run_id == run["id"])).all()
        }
    t = now_ms()
    cap = 10**6
    for i in range(0, 1000, 100):
        batch = [
            PendingReport(run["id"], pks[hostile.body["peer_id"]], t + i + j, 1,
                          (2**53 if j % 2 == 0 else 0), 1.0, None, None, samples_cap=cap)
            for j in range(100)
        ] + [PendingReport(run["id"], pks[honest[0].body["peer_id"]], t + i, 10, 100 + i, 1.0, None, None)]  # fmt: skip
        with factory() as session, session.begin():
            write_reports(session, batch, snapshot_interval_s=1e-6, online_ttl_s=60)
    with factory() as session:
        row = session.get(Peer, pks[hostile.body["peer_id"]])
        assert row is not None and row.samples_base + row.samples <= cap
    peers = await _peers(api.client, run["id"])
    assert peers[honest[0].body["peer_id"]]["samples"] == 1000


def test_counters_are_bounded_since_the_previous_report() -> None:
    """A peer silent for a long time cannot spend that time's allowance in one report, and
    the rounds one report carries are bounded by the time since the previous one."""
    joined_long_ago = PeerTrack(
        first_seen_ms=0, volunteer_id=1, banked=0, samples=1000, as_of_ms=3_600_000
    )
    now = 3_610_000  # 10 s after its previous report, an hour after it joined
    assert _check(joined_long_ago, samples=1000 + 70_000, now_ms=now) is None  # (10 + 60) s
    assert _check(joined_long_ago, samples=1000 + 70_001, now_ms=now) is Bound.samples
    assert LIMITS.rounds_cap(3_600_000, now) == 50 * 10 + 100
    assert _check(joined_long_ago, samples=1000, rounds=600, now_ms=now) is None
    assert _check(joined_long_ago, samples=1000, rounds=601, now_ms=now) is Bound.rounds
    assert _check(joined_long_ago, samples=1000, rounds=2**53, now_ms=now) is Bound.rounds


def test_losses_metrics_and_groups_out_of_range() -> None:
    track = PeerTrack(first_seen_ms=0, volunteer_id=1, banked=0, samples=0, as_of_ms=None)
    for value in (1e6, -1e6, 0.0):
        assert _check(track, loss=value, eval_metric=value) is None
    assert _check(track, loss=1e300) is Bound.loss
    assert _check(track, loss=-1.5e6) is Bound.loss
    assert _check(track, eval_metric=-1e300) is Bound.eval_metric
    view = SwarmView(read_ms=0, online={}, highest=0, peers=4)
    assert _check(track, view, group_size=4) is None
    assert _check(track, view, group_size=5) is Bound.group_size
    assert _check(track, None, group_size=4096) is None  # no view: the hard cap only
    assert _check(track, None, group_size=10**6) is Bound.group_size


async def test_a_peer_that_just_joined_counts_in_a_group(
    api: Api, run: dict[str, Any], join_token: str
) -> None:
    a, _ = await api.join(run["id"], join_token), await api.join(run["id"], join_token)
    assert (await api.report(run["id"], a, group_size=2)).status_code == 202  # view: 2 peers
    await api.join(run["id"], join_token)
    assert (await api.report(run["id"], a, group_size=3)).status_code == 202  # counted again
    refused = await api.report(run["id"], a, group_size=4)
    assert refused.status_code == 422, refused.text
    assert "group_size 4 is larger than the 3 peers" in refused.text


async def test_group_size_refusals_never_renew_the_epoch_view(database_url: str) -> None:
    """A new view would forget who the epoch bound lifted in it: a liar alternating absurd
    groups and epochs would climb a lead per recount instead of per refresh."""
    settings = make_settings(database_url, report_max_epoch_lead=5, report_swarm_refresh_s=60)
    async with running(create_app(settings)) as app, client_for(app) as client:
        await _alternate(Api(client))


async def _alternate(api: Api) -> None:
    run = await api.create_run()
    liar = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
    assert (await api.report(run["id"], liar, epoch=0)).status_code == 202
    for _ in range(3):
        assert (await api.report(run["id"], liar, epoch=100)).status_code == 422
        assert (await api.report(run["id"], liar, group_size=50)).status_code == 422
    assert (await api.report(run["id"], liar, epoch=6)).status_code == 422  # still 0 + 5


def test_the_swarm_epoch_kept_as_reports_arrive_is_the_one_counted_from_scratch() -> None:
    """The view keeps its two highest volunteers as epochs rise, so that a report costs the
    same at 10,000 volunteers as at 10: the answer must be what a scan of them all gives."""
    import random

    def scanned(view: SwarmView, volunteer_id: int) -> int:
        others = [e for v, e in view.online.items() if v != volunteer_id]
        return max(others) if len(others) >= 2 else max([view.highest, *others])

    rng = random.Random(7)
    for _ in range(200):
        online = {v: rng.randrange(20) for v in range(rng.randrange(5))}
        view = SwarmView(read_ms=0, online=online, highest=rng.randrange(25))
        for step in range(30):
            v, epoch = rng.randrange(6), rng.randrange(30)
            (view.saw if rng.random() < 0.7 else view.lift)(v, epoch, step)
            for reporter in range(7):
                assert swarm_epoch(view, reporter) == scanned(view, reporter)
