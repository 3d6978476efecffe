"""A run's checkpoints: peers upload them as they train; joining peers and the organizer
download the served one (pinned, else newest); the organizer lists, pins and deletes them."""

from __future__ import annotations

import asyncio
import re

from fastapi import APIRouter, Path, Query, Request, Response, status
from fastapi.responses import FileResponse, JSONResponse
from sqlalchemy.orm import Session
from starlette.types import Scope

from server.api import API_PREFIX
from server.api.deps import (
    CheckpointStoreDep,
    CurrentOrganizer,
    CurrentPeer,
    CurrentRunReader,
    ReportGuardDep,
    RunDep,
    SessionDep,
    SettingsDep,
)
from server.schemas import MAX_INT, CheckpointHeld, CheckpointPublic, CheckpointsPublic, ErrorPublic
from server.services import checkpoints as checkpoint_service
from server.services import runs as run_service

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["checkpoints"])

_UPLOAD_PATH = re.compile(rf"^{re.escape(API_PREFIX)}/runs/[^/]+/checkpoint$")


def is_upload(scope: Scope) -> bool:
    """The upload request, which enforces its own (larger) body limit while it streams."""
    return scope["method"] == "PUT" and _UPLOAD_PATH.match(scope["path"]) is not None


@router.put(
    "/checkpoint",
    status_code=status.HTTP_201_CREATED,
    response_model=CheckpointPublic,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        }
    },
    responses={
        202: {
            "model": CheckpointHeld,
            "description": "Not this epoch's uploader, or an epoch more than one past "
            "what the other volunteers reached: only the digest is kept (never served), "
            "until a volunteer of another invite uploads the same at a reached epoch.",
        },
        413: {"model": ErrorPublic, "description": "Over checkpoint_max_bytes."},
        422: {
            "model": ErrorPublic,
            "description": "Not a zip archive, or an epoch the swarm has not reached.",
        },
        507: {"model": ErrorPublic, "description": "The coordinator's disk refused the file."},
    },
)
async def upload_checkpoint(
    peer: CurrentPeer,
    session: SessionDep,
    store: CheckpointStoreDep,
    guard: ReportGuardDep,
    settings: SettingsDep,
    run: RunDep,
    request: Request,
    epoch: int = Query(ge=0, le=MAX_INT, description="The swarm epoch the model is at."),
) -> Response:
    """Upload the model at ``epoch``: the raw bytes ``torch.save`` wrote (a zip archive),
    as ``application/octet-stream``. Taken (201) from the peer the run designates for the
    epoch (the lowest peer id among the peers at it or the one before), at most one epoch
    past what the other volunteers reached; from another peer only its digest is kept
    (202) until a volunteer of another invite uploads the same, and an epoch further ahead
    is held likewise (202): never served, and blocking no upload of an earlier epoch.
    409 when the run has a checkpoint of the same or a newer epoch (another peer was first:
    nothing to do); 413 over the size limit; 422 for an epoch the swarm has not reached or
    anything but a zip archive; 507 when the coordinator cannot store it."""
    assert peer.peer_pk is not None
    length = request.headers.get("content-length", "")
    uploaded = await checkpoint_service.upload(
        session,
        store,
        run,
        peer.peer_pk,
        epoch,
        request.stream(),
        int(length) if length.isdigit() else None,
        guard=guard,
        online_ttl_s=settings.peer_online_ttl_s,
        report_interval_s=settings.report_interval_s,
    )
    if uploaded.checkpoint is None:
        held = CheckpointHeld(epoch=epoch, detail=uploaded.detail)
        return JSONResponse(held.model_dump(mode="json"), status_code=status.HTTP_202_ACCEPTED)
    body = checkpoint_service.public(uploaded.checkpoint)
    # The checkpoint of the run's last epoch may finish it (when the swarm is there too).
    await asyncio.to_thread(_finish_if_done, session, run.id, settings.peer_online_ttl_s)
    return JSONResponse(body.model_dump(mode="json"), status_code=status.HTTP_201_CREATED)


def _finish_if_done(session: Session, run_id: str, online_ttl_s: float) -> None:
    if run_service.finish_if_done(session, run_id, online_ttl_s=online_ttl_s):
        session.commit()


@router.get(
    "/checkpoint",
    response_class=FileResponse,
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "The served checkpoint (pinned, else newest); its epoch and "
            "SHA-256 in the "
            "X-Checkpoint-Epoch and X-Checkpoint-SHA256 headers.",
        }
    },
)
def download_checkpoint(
    _: CurrentRunReader, session: SessionDep, store: CheckpointStoreDep, run: RunDep
) -> FileResponse:
    """The run's served checkpoint: the one the organizer pinned, else the newest (404 when
    there is none yet). Load it with ``model.load_state_dict(torch.load(path)["model"])``."""
    checkpoint, path = checkpoint_service.served_file(session, store, run.id)
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=f"{run.id}-epoch-{checkpoint.epoch}.pt",
        headers={
            "X-Checkpoint-Epoch": str(checkpoint.epoch),
            "X-Checkpoint-SHA256": checkpoint.sha256,
        },
    )


@router.get("/checkpoints", response_model=CheckpointsPublic)
def list_checkpoints(_: CurrentOrganizer, session: SessionDep, run: RunDep) -> CheckpointsPublic:
    """The checkpoints kept for the run, newest first."""
    return CheckpointsPublic(
        checkpoints=[
            checkpoint_service.public(c)
            for c in checkpoint_service.list_checkpoints(session, run.id)
        ]
    )


EpochPath = Path(ge=0, le=MAX_INT, description="The checkpoint's epoch.")


@router.post("/checkpoints/{epoch}/pin", response_model=CheckpointPublic)
def pin_checkpoint(
    _: CurrentOrganizer, session: SessionDep, run: RunDep, epoch: int = EpochPath
) -> CheckpointPublic:
    """Serve this checkpoint (downloads, joining peers) instead of the newest, and keep it,
    until it is unpinned or deleted; any other pin of the run is dropped."""
    checkpoint = checkpoint_service.pin(session, run.id, epoch)
    session.commit()
    return checkpoint_service.public(checkpoint)


@router.delete("/checkpoints/pin", status_code=status.HTTP_204_NO_CONTENT)
def unpin_checkpoint(_: CurrentOrganizer, session: SessionDep, run: RunDep) -> Response:
    """Serve the newest checkpoint again."""
    checkpoint_service.unpin(session, run.id)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.delete("/checkpoints/{epoch}", status_code=status.HTTP_204_NO_CONTENT)
def delete_checkpoint(
    _: CurrentOrganizer,
    session: SessionDep,
    store: CheckpointStoreDep,
    run: RunDep,
    epoch: int = EpochPath,
) -> Response:
    """Remove the checkpoint of ``epoch`` (row and file); peers' uploads of epochs after the
    next newest are taken again."""
    checkpoint_service.delete_checkpoint(session, store, run.id, epoch)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
