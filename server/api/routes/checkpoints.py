"""A run's checkpoints: peers upload them as they train; joining peers and the organizer
download the newest."""

from __future__ import annotations

import re

from fastapi import APIRouter, Query, Request, status
from fastapi.responses import FileResponse
from starlette.types import Scope

from server.api import API_PREFIX
from server.api.deps import (
    CheckpointStoreDep,
    CurrentOrganizer,
    CurrentPeer,
    CurrentRunReader,
    RunDep,
    SessionDep,
)
from server.schemas import MAX_INT, CheckpointPublic, CheckpointsPublic, ErrorPublic
from server.services import checkpoints as checkpoint_service

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
        413: {"model": ErrorPublic, "description": "Over checkpoint_max_bytes."},
        422: {"model": ErrorPublic, "description": "Not a zip archive, or a bad epoch."},
        507: {"model": ErrorPublic, "description": "The coordinator's disk refused the file."},
    },
)
async def upload_checkpoint(
    peer: CurrentPeer,
    session: SessionDep,
    store: CheckpointStoreDep,
    run: RunDep,
    request: Request,
    epoch: int = Query(ge=0, le=MAX_INT, description="The swarm epoch the model is at."),
) -> CheckpointPublic:
    """Upload the model at ``epoch``: the raw bytes ``torch.save`` wrote (a zip archive),
    as ``application/octet-stream``. 409 when the run has a checkpoint of the same or a
    newer epoch (another peer was first: nothing to do); 413 over the size limit; 422 for
    anything but a zip archive; 507 when the coordinator cannot store it."""
    assert peer.peer_pk is not None
    length = request.headers.get("content-length", "")
    checkpoint = await checkpoint_service.upload(
        session,
        store,
        run,
        peer.peer_pk,
        epoch,
        request.stream(),
        int(length) if length.isdigit() else None,
    )
    return checkpoint_service.public(checkpoint)


@router.get(
    "/checkpoint",
    response_class=FileResponse,
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "The newest checkpoint; its epoch and SHA-256 in the "
            "X-Checkpoint-Epoch and X-Checkpoint-SHA256 headers.",
        }
    },
)
def download_checkpoint(
    _: CurrentRunReader, session: SessionDep, store: CheckpointStoreDep, run: RunDep
) -> FileResponse:
    """The run's newest checkpoint (404 when there is none yet). Load it with
    ``model.load_state_dict(torch.load(path)["model"])``."""
    checkpoint, path = checkpoint_service.newest_file(session, store, run.id)
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
