"""Runs: create, list, read, change, archive."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response, status
from sqlalchemy.orm import Session

from server.api import API_PREFIX
from server.api.deps import (
    CurrentOrganizer,
    KeyBoxDep,
    RunDep,
    SessionDep,
    SettingsDep,
    TaskReader,
)
from server.models import Run
from server.schemas import (
    RevocationsPublic,
    RunCreate,
    RunPublic,
    RunsPublic,
    RunUpdate,
    TaskFilePublic,
    encode_bytes,
)
from server.services import revocations as revocation_service
from server.services import runs as run_service
from server.services import task_files

router = APIRouter(prefix=f"{API_PREFIX}/runs", tags=["runs"])


def run_public(
    run: Run, online: int | None = None, task_file: TaskFilePublic | None = None
) -> RunPublic:
    """The run's public model; ``online``: its volunteers online, shown while it waits;
    ``task_file``: the task file it ships."""
    waiting = run_service.waiting(run)
    return RunPublic(
        id=run.id,
        name=run.name,
        task=run.task,
        config=run.config,
        status=run.status,
        created_at=run.created_at,
        updated_at=run.updated_at,
        archived_at=run.archived_at,
        public_key=encode_bytes(run.authority_public_key),
        min_volunteers=run.min_volunteers if waiting else None,
        volunteers_online=online if waiting else None,
        finished_at_epoch=run.finished_at_epoch,
        status_detail=run_service.status_detail(run, online if waiting else None),
        revocations_serial=None,
        task_file=task_file,
    )


def runs_public(session: Session, runs: list[Run], online_ttl_s: float) -> list[RunPublic]:
    """``runs``' public models; one count of the volunteers online for those that wait."""
    online = run_service.volunteers_online(
        session,
        [r.id for r in runs if run_service.waiting(r)],
        online_ttl_s=online_ttl_s,
        ready=True,
    )
    return [run_public(r, online.get(r.id, 0), task_files.public(session, r)) for r in runs]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunPublic)
def create_run(
    _: CurrentOrganizer, session: SessionDep, keybox: KeyBoxDep, body: RunCreate
) -> RunPublic:
    """Create a run with its own signing authority: ``running``, or with ``min_volunteers``
    N ``paused`` until N volunteers are online (it then starts by itself). Next: make an
    invite with ``POST /runs/{run_id}/tokens``."""
    run = run_service.create_run(session, keybox, body)
    session.commit()
    return run_public(run, 0, task_files.public(session, run))


@router.get("", response_model=RunsPublic)
def list_runs(
    session: SessionDep,
    settings: SettingsDep,
    include_archived: bool = Query(False, description="Also list archived runs."),
) -> RunsPublic:
    """Runs, newest first. Public: dashboards and volunteers read it."""
    runs = run_service.list_runs(session, include_archived=include_archived)
    return RunsPublic(runs=runs_public(session, runs, settings.peer_online_ttl_s))


@router.get("/{run_id}", response_model=RunPublic)
def read_run(session: SessionDep, settings: SettingsDep, run: RunDep) -> RunPublic:
    """The run, with the serial of its revocation list (peers poll this)."""
    [answer] = runs_public(session, [run], settings.peer_online_ttl_s)
    answer.revocations_serial = revocation_service.serial(session, run)
    return answer


@router.get("/{run_id}/revocations", response_model=RevocationsPublic)
def read_revocations(
    session: SessionDep, keybox: KeyBoxDep, settings: SettingsDep, run: RunDep
) -> RevocationsPublic:
    """The peers this run's organizers banned, signed by the run's authority: every peer
    drops their links and records and passes the list on. Public: it is signed."""
    revocations = revocation_service.revocation_list(
        session, keybox, run, settings.certificate_ttl_s
    )
    return RevocationsPublic(serial=revocations.serial, list=revocations.to_base64())


@router.get(
    "/{run_id}/task",
    response_class=Response,
    responses={
        200: {
            "content": {"text/x-python": {}},
            "description": "The task file the run ships; its SHA-256 in the X-Task-SHA256 "
            "header (the run's task_file names it too).",
        },
        404: {"description": "The run ships no task file."},
    },
)
def read_task_file(_: TaskReader, session: SessionDep, run: RunDep) -> Response:
    """The task file the run ships, for its volunteers (an invite of the run, a peer token
    of it) and organizers. Check it against the run's ``task_file.sha256`` before running
    it."""
    data, digest = task_files.content(session, run)
    return Response(data, media_type="text/x-python", headers={"X-Task-SHA256": digest})


@router.patch("/{run_id}", response_model=RunPublic)
def update_run(
    _: CurrentOrganizer, session: SessionDep, settings: SettingsDep, run: RunDep, body: RunUpdate
) -> RunPublic:
    """Pause, resume or finish a run, hold it until ``min_volunteers`` are online (null: stop
    waiting), rename it or replace its config. Finished and archived runs are final (409)."""
    ttl = settings.peer_online_ttl_s
    run_service.update_run(session, run, body, online_ttl_s=ttl)
    session.commit()
    [answer] = runs_public(session, [run], ttl)
    return answer


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT)
def archive_run(_: CurrentOrganizer, session: SessionDep, run: RunDep) -> None:
    """Archive: the run is finished and hidden from the default listing; its data stay.
    Archiving twice is harmless."""
    run_service.archive_run(session, run)
    session.commit()
