"""Whole answers of the coordinator, as its payload types (peer.formats.payloads) have them,
for the tests that stand in for it with httpx.MockTransport."""

from __future__ import annotations

from typing import Any

from peer.formats.payloads import ProgressPublic, RunPublic

WHEN = "2030-01-01T00:00:00Z"


def run_body(**fields: Any) -> dict[str, Any]:
    """A run as ``GET /runs/{id}`` answers it; ``fields`` replace the defaults."""
    body: dict[str, Any] = {
        "id": "r1",
        "name": "mnist",
        "task": "digits",
        "config": {},
        "status": "running",
        "created_at": WHEN,
        "updated_at": WHEN,
        "archived_at": None,
        "public_key": "k",
        "min_volunteers": None,
        "volunteers_online": None,
        "finished_at_epoch": None,
        "status_detail": None,
        "revocations_serial": None,
    }
    body.update(fields)
    RunPublic.model_validate(body)  # a stand-in that drifts from the contract fails here
    return body


def progress_body(**fields: Any) -> dict[str, Any]:
    """A run's progress as ``GET /runs/{id}/progress`` answers it, before any report."""
    body: dict[str, Any] = {
        "run_id": "r1",
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
    body.update(fields)
    ProgressPublic.model_validate(body)
    return body
