"""Runs: create, list, read, change, archive."""

from __future__ import annotations

from fastapi import APIRouter, Query, status

from server.api import API_PREFIX
from server.api.deps import CurrentOrganizer, KeyBoxDep, RunDep, SessionDep, SettingsDep
from server.models import Run
from server.schemas import (
    RevocationsPublic,
    RunCreate,
    RunPublic,
    RunsPublic,
    RunUpdate,
    encode_bytes,
)
from server.services import revocations as revocation_service
from server.services import runs as run_service

router = APIRouter(prefix=f"{API_PREFIX}/runs", tags=["runs"])


def run_public(run: Run) -> RunPublic:
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
        revocations_serial=None,
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunPublic)
def create_run(
    _: CurrentOrganizer, session: SessionDep, keybox: KeyBoxDep, body: RunCreate
) -> RunPublic:
    """Create a run (status ``running``) with its own signing authority. Next: make an
    invite with ``POST /runs/{run_id}/tokens``."""
    run = run_service.create_run(session, keybox, body)
    session.commit()
    return run_public(run)


@router.get("", response_model=RunsPublic)
def list_runs(
    session: SessionDep,
    include_archived: bool = Query(False, description="Also list archived runs."),
) -> RunsPublic:
    """Runs, newest first. Public: dashboards and volunteers read it."""
    return RunsPublic(
        runs=[
            run_public(r) for r in run_service.list_runs(session, include_archived=include_archived)
        ]
    )


@router.get("/{run_id}", response_model=RunPublic)
def read_run(session: SessionDep, run: RunDep) -> RunPublic:
    """The run, with the serial of its revocation list (peers poll this)."""
    answer = run_public(run)
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


@router.patch("/{run_id}", response_model=RunPublic)
def update_run(_: CurrentOrganizer, session: SessionDep, run: RunDep, body: RunUpdate) -> RunPublic:
    """Pause, resume or finish a run, rename it or replace its config. Finished and
    archived runs are final (409)."""
    run_service.update_run(session, run, body)
    session.commit()
    return run_public(run)


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT)
def archive_run(_: CurrentOrganizer, session: SessionDep, run: RunDep) -> None:
    """Archive: the run is finished and hidden from the default listing; its data stay.
    Archiving twice is harmless."""
    run_service.archive_run(session, run)
    session.commit()
