"""The dashboard's data: the runs list, a run's dashboard, a volunteer's page (public JSON),
their live WebSockets, and the organizer's ban."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable
from typing import Annotated, Literal

from fastapi import (
    APIRouter,
    Depends,
    Path,
    Query,
    Request,
    Response,
    WebSocket,
    WebSocketDisconnect,
)
from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker

from server.api import API_PREFIX
from server.api.deps import CurrentOrganizer, RunDep, SessionDep, SettingsDep
from server.config import Settings
from server.document_cache import DocumentCache
from server.exceptions import NotFound
from server.live import Build, LiveHub
from server.models import Run
from server.schemas_dashboard import (
    RunDashboard,
    RunsOverview,
    VolunteerBanned,
    VolunteerDetail,
    VolunteerPage,
    VolunteerSort,
)
from server.services import dashboard as dashboard_service
from server.services import runs as run_service
from server.services import volunteer_table
from server.services import volunteers as volunteer_service
from server.services.dashboard import DEFAULT_VIEW, MAX_ID
from server.services.volunteer_table import View

router = APIRouter(prefix=API_PREFIX, tags=["dashboard"])

PING_INTERVAL_S = 15.0
CLOSE_UNKNOWN_RUN = 4404


def cached_runs_overview(request: Request, settings: Settings) -> Response:
    """The runs list as JSON, from the worker's cache (:func:`_cached`)."""
    ttl = settings.peer_online_ttl_s
    return _cached(
        request,
        ("runs",),
        lambda session: dashboard_service.runs_overview(session, online_ttl_s=ttl),
    )


def cached_run_dashboard(
    request: Request, session: Session, settings: Settings, run: Run, view: View
) -> Response:
    """A run's dashboard document as JSON: the run's, from the worker's cache (one per run,
    whatever ``view``), with the page of the volunteers' table ``view`` asks for read now
    in place of the default one."""
    run_id = run.id

    def build(session: Session) -> RunDashboard:
        return dashboard_service.run_dashboard(
            session,
            run_service.get_run(session, run_id),
            online_ttl_s=settings.peer_online_ttl_s,
            history_points=settings.history_points,
        )

    cached = _cached(request, ("run", run_id), build)
    if view == DEFAULT_VIEW:
        return cached
    page = dashboard_service.volunteers_page(
        session, run, online_ttl_s=settings.peer_online_ttl_s, view=view
    )
    document = dashboard_service.with_page(bytes(cached.body), page)
    return Response(document, media_type="application/json")


def _cached(request: Request, key: Hashable, build: Callable[[Session], BaseModel]) -> Response:
    """The document ``build`` makes from a session of its own, from the worker's cache
    (:class:`~server.document_cache.DocumentCache`: rebuilt behind a read that finds it older
    than ``dashboard_cache_s``), serialised
    once as built: the response model is for the schema; validating a document of a thousand
    volunteers again would cost as much as building it."""
    factory: sessionmaker[Session] = request.app.state.session_factory

    def document() -> str:
        with factory() as session:
            return build(session).model_dump_json()

    cache: DocumentCache = request.app.state.dashboard_cache
    return Response(cache.get(key, document), media_type="application/json")


@router.get("/dashboard", response_model=RunsOverview)
def read_runs_overview(request: Request, settings: SettingsDep) -> Response:
    """Every run that is not archived, with its current numbers and a throughput trend."""
    return cached_runs_overview(request, settings)


def volunteer_view(
    page: int = Query(1, ge=1, le=volunteer_table.MAX_PAGE, description="1-based."),
    per_page: int = Query(volunteer_table.DEFAULT_PER_PAGE, ge=1, le=volunteer_table.MAX_PER_PAGE),
    sort: VolunteerSort = Query("samples", description="The column to sort by."),
    order: Literal["asc", "desc"] = Query("desc"),
    q: str = Query(
        "", max_length=volunteer_table.MAX_QUERY, description="Part of a display name, any case."
    ),
) -> View:
    """Which page of the volunteers' table to send."""
    return View(page=page, per_page=per_page, sort=sort, order=order, q=q)


ViewDep = Annotated[View, Depends(volunteer_view)]


@router.get("/runs/{run_id}/dashboard", response_model=RunDashboard)
def read_run_dashboard(
    request: Request, session: SessionDep, settings: SettingsDep, run: RunDep, view: ViewDep
) -> Response:
    """Headline numbers, alerts, chart series, group sizes, and one page of the volunteers'
    table with their counts (the first page by samples unless the query asks for another).
    Each worker builds the run's document at most every ``dashboard_cache_s`` (1 s by
    default), one per run whatever the query: another page, order or filter of the table
    is that page alone (as ``GET .../volunteers`` answers it) in the cached document, so
    varied queries cost a table query each, never a build, and push no run out of the
    cache."""
    return cached_run_dashboard(request, session, settings, run, view)


@router.get("/runs/{run_id}/volunteers", response_model=VolunteerPage)
def read_volunteers(
    session: SessionDep, settings: SettingsDep, run: RunDep, view: ViewDep
) -> Response:
    """One page of the volunteers' table, sorted and filtered here: what the dashboard asks
    for when someone pages, sorts or filters the table."""
    document = dashboard_service.volunteers_page(
        session, run, online_ttl_s=settings.peer_online_ttl_s, view=view
    )
    return Response(document.model_dump_json(), media_type="application/json")


@router.get("/runs/{run_id}/volunteers/{ref}", response_model=VolunteerDetail)
def read_volunteer(
    session: SessionDep,
    settings: SettingsDep,
    run: RunDep,
    ref: str = Path(min_length=1, max_length=64, description="Volunteer id or display name."),
) -> VolunteerDetail:
    return dashboard_service.volunteer_detail(
        session,
        run,
        ref,
        online_ttl_s=settings.peer_online_ttl_s,
        retention_s=settings.report_retention_s,
    )


@router.post("/runs/{run_id}/volunteers/{volunteer_id}/ban", response_model=VolunteerBanned)
def ban_volunteer(
    _: CurrentOrganizer,
    session: SessionDep,
    run: RunDep,
    volunteer_id: int = Path(ge=1, le=MAX_ID, description="The volunteer's id."),
    revoke_invites: bool = Query(
        False, description="Also revoke the invites the volunteer came through."
    ),
) -> VolunteerBanned:
    """Revoke every token of the volunteer; its keys can no longer join or renew. The
    answer names the invites it came through (shared ones too); ``revoke_invites=true``
    revokes them as well, so the person cannot come back with a new key."""
    volunteer = volunteer_service.ban(session, run, volunteer_id)
    revoked = []
    if revoke_invites:
        revoked = volunteer_service.revoke_invites_used(session, run, volunteer_id)
    invites = [t.id for t in volunteer_service.invites_used(session, volunteer)]
    session.commit()
    return VolunteerBanned(
        id=volunteer.id,
        display_name=volunteer.display_name,
        banned=True,
        invites=invites,
        invites_revoked=[t.id for t in revoked],
    )


def _overview_builder(factory: sessionmaker[Session], settings: Settings) -> Build:
    def build() -> dict[str, object]:
        with factory() as session:
            document = dashboard_service.runs_overview(
                session, online_ttl_s=settings.peer_online_ttl_s
            )
            return {
                "type": "runs",
                "version": document.version,
                "data": document.model_dump(mode="json"),
            }

    return build


def _dashboard_builder(factory: sessionmaker[Session], settings: Settings, run_id: str) -> Build:
    def build() -> dict[str, object] | None:
        with factory() as session:
            try:
                run = run_service.get_run(session, run_id)
            except NotFound:
                return None
            document = dashboard_service.run_dashboard(
                session,
                run,
                online_ttl_s=settings.peer_online_ttl_s,
                history_points=settings.history_points,
            )
            return {
                "type": "dashboard",
                "version": document.version,
                "data": document.model_dump(mode="json"),
            }

    return build


async def _stream(websocket: WebSocket, key: tuple[str, ...], build: Build) -> None:
    hub: LiveHub = websocket.app.state.live_hub
    await websocket.accept()
    async with hub.subscribe(key, build) as queue:
        left = asyncio.create_task(_drain(websocket))
        try:
            while True:
                document_ready = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait(
                    {document_ready, left},
                    timeout=PING_INTERVAL_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if left in done:  # the browser left
                    document_ready.cancel()
                    return
                if document_ready not in done:
                    document_ready.cancel()
                    await websocket.send_json({"type": "ping"})
                    continue
                document = document_ready.result()
                if document is None:
                    await websocket.close(CLOSE_UNKNOWN_RUN, "no such run")
                    return
                await websocket.send_json({"type": document["type"], "data": document["data"]})
        except (WebSocketDisconnect, RuntimeError):
            return  # the browser left while we were sending
        finally:
            left.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await left


async def _drain(websocket: WebSocket) -> None:
    """Clients send nothing; reading notices when they leave."""
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        while True:
            await websocket.receive_text()


@router.websocket("/live")
async def live_runs(websocket: WebSocket) -> None:
    """The runs list, as JSON text frames ``{"type": "runs", "data": ...}`` at connect and on
    every change, and ``{"type": "ping"}`` every 15 s."""
    app = websocket.app
    build = _overview_builder(app.state.session_factory, app.state.settings)
    await _stream(websocket, ("runs",), build)


@router.websocket("/runs/{run_id}/live")
async def live_dashboard(websocket: WebSocket, run_id: str) -> None:
    """A run's dashboard, as ``{"type": "dashboard", "data": ...}`` frames at connect and on
    every change; an unknown run closes with code 4404."""
    app = websocket.app
    build = _dashboard_builder(app.state.session_factory, app.state.settings, run_id[:32])
    await _stream(websocket, ("run", run_id[:32]), build)
