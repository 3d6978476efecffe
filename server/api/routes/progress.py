"""A run's progress: what dashboards and volunteers' progress bars show."""

from __future__ import annotations

from fastapi import APIRouter

from server.api import API_PREFIX
from server.api.deps import RunDep, SessionDep, SettingsDep
from server.schemas import ProgressPublic
from server.services import progress as progress_service

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["progress"])


@router.get("/progress", response_model=ProgressPublic)
def read_progress(session: SessionDep, settings: SettingsDep, run: RunDep) -> ProgressPublic:
    """Current epoch, samples, throughput and peers online (from each peer's latest report),
    recent averaging group sizes and epochs, and a downsampled history for charts. Public."""
    return progress_service.progress(
        session,
        run,
        online_ttl_s=settings.peer_online_ttl_s,
        history_points=settings.history_points,
    )
