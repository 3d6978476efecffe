"""Reports, progress, history, and a coordinator restart mid-run (point 6)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select

from server.app import create_app
from server.clock import now_ms
from server.db import make_engine, make_session_factory, upgrade_database
from server.models import EpochSummary, Peer, ProgressReport
from server.services.report_buffer import ReportBuffer
from server.services.reports import PendingReport, write_reports
from tests.server.conftest import ORGANIZER, Api, client_for, make_settings, running


async def flush(app: FastAPI) -> None:
    await app.state.report_buffer.flush()


async def progress(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/v1/runs/{run_id}/progress")
    assert response.status_code == 200, response.text
    return response.json()


async def test_progress_of_a_new_run_is_empty(
    client: httpx.AsyncClient, run: dict[str, Any]
) -> None:
    body = await progress(client, run["id"])
    assert body == {
        "run_id": run["id"],
        "status": "running",
        "epoch": 0,
        "samples": 0,
        "samples_per_second": 0.0,
        "compute_samples_per_second": 0.0,
        "peers_online": 0,
        "loss": None,
        "eval_metric": None,
        "rounds_done": 0,
        "rounds_failed": 0,
        "bytes_per_sample": None,
        "checkpoint": None,
        "recent_group_sizes": [],
        "epochs": [],
        "history": [],
    }


async def test_reports_add_up(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    a = await api.join(run["id"], join_token)
    b = await api.join(run["id"], join_token)
    for peer, epoch, samples, sps, loss, group in [
        (a, 0, 100, 10.0, 2.0, None),
        (b, 0, 50, 5.0, 3.0, 2),
        (a, 1, 300, 20.0, 1.0, 2),
    ]:
        response = await api.report(
            run["id"],
            peer,
            epoch=epoch,
            samples=samples,
            samples_per_second=sps,
            loss=loss,
            group_size=group,
        )
        assert response.status_code == 202 and response.json() == {"status": "accepted"}
    await flush(app)
    body = await progress(client, run["id"])
    assert body["epoch"] == 1
    assert body["samples"] == 350  # a's latest counter (300) + b's (50)
    # Claimed: a's latest + b's; counted: the counters' growth, none measured yet.
    assert body["compute_samples_per_second"] == pytest.approx(25.0)
    assert body["samples_per_second"] == 0.0
    assert body["peers_online"] == 2
    assert body["recent_group_sizes"] == [2, 2]
    epochs = {e["epoch"]: e for e in body["epochs"]}
    assert epochs[0]["reports"] == 2 and epochs[0]["mean_loss"] == pytest.approx(2.5)
    assert epochs[1]["reports"] == 1 and epochs[1]["max_group_size"] == 2
    assert [e["epoch"] for e in body["epochs"]] == [0, 1]
    # The first batch written takes a snapshot (the next is due in 5 s); the background
    # flusher may have written the first reports in a batch of their own.
    assert len(body["history"]) == 1
    assert body["history"][0]["samples"] in {100, 150, 350}

    listed = (await client.get(f"/api/v1/runs/{run['id']}/peers", headers=ORGANIZER)).json()
    by_id = {p["peer_id"]: p for p in listed["peers"]}
    assert by_id[a.body["peer_id"]]["samples"] == 300 and by_id[a.body["peer_id"]]["epoch"] == 1


async def test_a_peer_restarting_its_counter_does_not_shrink_the_total(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    peer = await api.join(run["id"], join_token)
    await api.report(run["id"], peer, samples=100)
    await flush(app)
    await api.report(run["id"], peer, samples=30)
    await flush(app)
    assert (await progress(client, run["id"]))["samples"] == 130


@pytest.mark.parametrize(
    "body",
    [
        {"epoch": -1, "samples": 0, "samples_per_second": 0},
        {"epoch": 0, "samples": -5, "samples_per_second": 0},
        {"epoch": 0, "samples": 0, "samples_per_second": -1},
        {"epoch": 0, "samples": 0, "samples_per_second": 0, "group_size": 0},
        {"epoch": 2**63, "samples": 0, "samples_per_second": 0},
        {"epoch": 0, "samples": 0},
        {"epoch": "one", "samples": 0, "samples_per_second": 0},
        {"epoch": 0, "samples": 0, "samples_per_second": 0, "rounds_done": -1},
        {"epoch": 0, "samples": 0, "samples_per_second": 0, "rounds_failed": -1},
        {"epoch": 0, "samples": 0, "samples_per_second": 0, "failure": "Timeout; DROP TABLE"},
        {"epoch": 0, "samples": 0, "samples_per_second": 0, "failure": "E" * 65},
        {"epoch": 0, "samples": 0, "samples_per_second": 0, "eval_metric": "high"},
    ],
)
async def test_invalid_reports_are_422(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str, body: dict[str, Any]
) -> None:
    peer = await api.join(run["id"], join_token)
    response = await client.post(
        f"/api/v1/runs/{run['id']}/reports", json=body, headers=peer.headers
    )
    assert response.status_code == 422


async def test_rounds_failures_and_the_held_out_metric(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    a = await api.join(run["id"], join_token)
    b = await api.join(run["id"], join_token)
    for peer, fields in [
        (a, {"epoch": 1, "loss": 2.0, "rounds_done": 3, "eval_metric": 0.5}),
        (b, {"epoch": 1, "loss": 1.0, "rounds_done": 2, "rounds_failed": 1,
             "failure": "AllreduceTimeout"}),
        (a, {"epoch": 2, "loss": 0.5, "rounds_done": 1, "rounds_failed": 2,
             "failure": "peer.averaging:GroupBroken"}),
    ]:  # fmt: skip
        response = await api.report(run["id"], peer, samples=10, samples_per_second=1.0, **fields)
        assert response.status_code == 202, response.text
    await flush(app)
    body = await progress(client, run["id"])
    assert (body["rounds_done"], body["rounds_failed"]) == (6, 3)
    assert body["loss"] == pytest.approx(0.75)  # a's latest (0.5) and b's (1.0)
    assert body["eval_metric"] == 0.5  # a's report without one did not erase it
    epochs = {e["epoch"]: e for e in body["epochs"]}
    assert (epochs[1]["rounds_done"], epochs[1]["rounds_failed"]) == (5, 1)
    assert (epochs[2]["rounds_done"], epochs[2]["rounds_failed"]) == (1, 2)
    with app.state.session_factory() as session:
        failures = session.scalars(select(ProgressReport.failure).order_by(ProgressReport.id)).all()
    assert failures == [None, "AllreduceTimeout", "peer.averaging:GroupBroken"]

    await api.report(run["id"], b, epoch=3, samples=20, samples_per_second=1.0, eval_metric=0.9)
    await flush(app)
    # The median of the online peers' latest metrics: a's 0.5 and b's 0.9.
    assert (await progress(client, run["id"]))["eval_metric"] == pytest.approx(0.7)


async def test_an_older_metric_never_replaces_a_newer_one(
    app: FastAPI, api: Api, run: dict[str, Any], join_token: str
) -> None:
    """As with the rest of a peer's state, batches of several workers compose in any order."""
    joined = await api.join(run["id"], join_token)
    factory = app.state.session_factory
    with factory() as session:
        pk = session.scalars(select(Peer.id).where(Peer.peer_id == joined.body["peer_id"])).one()
    t = now_ms()

    def report(ms: int, metric: float | None) -> PendingReport:
        return PendingReport(run["id"], pk, ms, 1, 1, 1.0, None, None, 1, 0, None, metric)

    # One batch holds the newest metric and a newer report without one; an older batch
    # with an older metric is written after it.
    with factory() as session, session.begin():
        write_reports(
            session, [report(t + 10, 0.8), report(t + 20, None)], snapshot_interval_s=5,
            online_ttl_s=60,
        )  # fmt: skip
    with factory() as session, session.begin():
        write_reports(session, [report(t, 0.3)], snapshot_interval_s=5, online_ttl_s=60)
    with factory() as session:
        fresh = session.get(Peer, pk)
        assert (fresh.eval_metric, fresh.eval_metric_ms, fresh.last_report_ms) == (
            0.8,
            t + 10,
            t + 20,
        )
        assert session.get(EpochSummary, (run["id"], 1)).rounds_done == 3


async def test_nan_loss_is_422(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    peer = await api.join(run["id"], join_token)
    response = await client.post(
        f"/api/v1/runs/{run['id']}/reports",
        content=b'{"epoch": 0, "samples": 1, "samples_per_second": 1, "loss": NaN}',
        headers={**peer.headers, "Content-Type": "application/json"},
    )
    assert response.status_code == 422


async def test_reports_to_a_finished_run_are_409(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    peer = await api.join(run["id"], join_token)
    await client.patch(f"/api/v1/runs/{run['id']}", json={"status": "paused"}, headers=ORGANIZER)
    assert (await api.report(run["id"], peer)).status_code == 202  # paused: still welcome
    await client.patch(f"/api/v1/runs/{run['id']}", json={"status": "finished"}, headers=ORGANIZER)
    refused = await api.report(run["id"], peer)
    assert refused.status_code == 409 and "stop training" in refused.json()["detail"]


async def test_history_is_downsampled(database_url: str) -> None:
    settings = make_settings(database_url, snapshot_interval_s=1e-6, history_points=3)
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run = await api.create_run()
        peer = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
        for samples in range(1, 11):
            response = await api.report(run["id"], peer, samples=samples * 10, loss=1.0 / samples)
            assert response.status_code == 202
            await flush(app)
        body = await progress(client, run["id"])
        assert body["samples"] == 100
        history = body["history"]
        assert 1 <= len(history) <= 3, history
        assert history[-1]["samples"] == 100, history
        assert [p["t"] for p in history] == sorted(p["t"] for p in history)
        assert [p["samples"] for p in history] == sorted(p["samples"] for p in history)


async def test_restart_keeps_runs_tokens_and_peers_and_reports_resume(database_url: str) -> None:
    """Point 6. The first coordinator acknowledges reports it has not written yet (long
    flush interval) and shuts down cleanly; the second finds everything."""
    settings = make_settings(database_url, report_flush_interval_s=3600)
    async with running(create_app(settings)) as first, client_for(first) as client:
        api = Api(client)
        run = await api.create_run()
        invite = await api.create_join_token(run["id"], max_uses=3)
        peer = await api.join(run["id"], invite["token"])
        for samples in (10, 20, 30):
            assert (await api.report(run["id"], peer, epoch=2, samples=samples)).status_code == 202
        assert first.state.report_buffer.pending == 3

    async with running(create_app(settings)) as second, client_for(second) as client:
        api = Api(client)
        again = (await client.get(f"/api/v1/runs/{run['id']}")).json()
        assert again == {**run, "revocations_serial": 0}
        body = await progress(client, run["id"])
        assert body["samples"] == 30 and body["epoch"] == 2 and body["epochs"][0]["reports"] == 3
        tokens = (await client.get(f"/api/v1/runs/{run['id']}/tokens", headers=ORGANIZER)).json()
        assert [(t["id"], t["uses"]) for t in tokens["tokens"]] == [(invite["id"], 1)]
        # The peer's token and the invite still work; reports resume.
        assert (await api.report(run["id"], peer, epoch=3, samples=40)).status_code == 202
        bootstrap = await client.get(f"/api/v1/runs/{run['id']}/bootstrap", headers=peer.headers)
        assert bootstrap.status_code == 200
        await api.join(run["id"], invite["token"])
        await flush(second)
        body = await progress(client, run["id"])
        assert body["samples"] == 40 and body["epoch"] == 3


async def test_out_of_order_batches_never_move_a_peer_back(
    app: FastAPI, api: Api, run: dict[str, Any], join_token: str
) -> None:
    """Two workers may write their batches in either order; the newest report wins."""
    joined = await api.join(run["id"], join_token)
    factory = app.state.session_factory
    with factory() as session:
        peer = session.scalars(select(Peer).where(Peer.peer_id == joined.body["peer_id"])).one()
    t = now_ms()

    def report(ms: int, epoch: int, samples: int) -> PendingReport:
        return PendingReport(run["id"], peer.id, ms, epoch, samples, 1.0, None, None)

    with factory() as session, session.begin():
        write_reports(session, [report(t + 10, 5, 500)], snapshot_interval_s=5, online_ttl_s=60)
    with factory() as session, session.begin():
        write_reports(session, [report(t, 4, 400)], snapshot_interval_s=5, online_ttl_s=60)
    with factory() as session:
        fresh = session.get(Peer, peer.id)
        assert (fresh.epoch, fresh.samples, fresh.samples_base, fresh.last_report_ms) == (
            5,
            500,
            0,
            t + 10,
        )
        assert session.scalar(select(func.count()).select_from(ProgressReport)) == 2
        summaries = {s.epoch: s.reports for s in session.scalars(select(EpochSummary))}
        assert summaries == {4: 1, 5: 1}


async def test_concurrent_flushes_compose(
    app: FastAPI, api: Api, run: dict[str, Any], join_token: str
) -> None:
    """Several buffers (as in several workers) writing the same epoch at once: the epoch
    summary counts every report exactly once."""
    peers = [await api.join(run["id"], join_token) for _ in range(4)]
    factory = app.state.session_factory
    with factory() as session:
        pks = [
            session.scalars(select(Peer.id).where(Peer.peer_id == p.body["peer_id"])).one()
            for p in peers
        ]
    # Buffers not entered have no flusher task: they write only when flushed, here all
    # four at once, each in its own thread and transaction.
    buffers = [
        ReportBuffer(
            factory, flush_interval_s=60, max_pending=1000, snapshot_interval_s=5, online_ttl_s=60
        )
        for _ in range(4)
    ]
    t = now_ms()
    for i, buffer in enumerate(buffers):
        for j in range(50):
            await buffer.add(PendingReport(run["id"], pks[i], t + j, 7, j, 1.0, 0.5, 4))
    written = await asyncio.gather(*(b.flush() for b in buffers))
    assert written == [50, 50, 50, 50]
    with factory() as session:
        summary = session.get(EpochSummary, (run["id"], 7))
        assert summary.reports == 200 and summary.loss_count == 200
        assert session.scalar(select(func.sum(Peer.samples))) == 4 * 49


async def test_buffer_applies_back_pressure_and_flushes_on_close(database_url: str) -> None:
    settings = make_settings(database_url)
    engine = make_engine(settings)
    upgrade_database(engine)
    factory = make_session_factory(engine)
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run = await api.create_run()
        peer = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
        with factory() as session:
            pk = session.scalars(select(Peer.id).where(Peer.peer_id == peer.body["peer_id"])).one()
    buffer = ReportBuffer(
        factory, flush_interval_s=3600, max_pending=5, snapshot_interval_s=5, online_ttl_s=60
    )
    # Not entered: no flusher task, so only the explicit flush() and close() write.
    for i in range(10):  # up to 2 * max_pending are accepted without waiting
        await buffer.add(PendingReport(run["id"], pk, now_ms(), 0, i, 1.0, None, None))
    blocked = asyncio.create_task(
        buffer.add(PendingReport(run["id"], pk, now_ms(), 0, 10, 1.0, None, None))
    )
    await asyncio.sleep(0)  # one turn of the loop: the task runs up to its wait
    assert not blocked.done()
    assert await buffer.flush() == 10
    await blocked
    assert buffer.pending == 1
    await buffer.close()
    assert buffer.pending == 0
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(ProgressReport)) == 11
    engine.dispose()
