"""Liveness and metrics, outside ``/api/v1``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy import text

from server.api.deps import SessionDep
from server.metrics import CONTENT_TYPE
from server.schemas import HealthPublic

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=HealthPublic)
def healthz(session: SessionDep) -> HealthPublic:
    """200 when the process serves requests and the database answers."""
    session.execute(text("SELECT 1"))
    return HealthPublic()


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format."}},
)
def metrics(request: Request) -> Response:
    """Prometheus text exposition; see ``server.metrics`` for what holds with several workers."""
    state = request.app.state
    buffer = getattr(state, "report_buffer", None)
    state.metrics.set_pending(buffer.pending if buffer is not None else 0)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
