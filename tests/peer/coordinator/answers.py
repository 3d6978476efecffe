"""Whole answers of the coordinator, as its payload types (peer.formats.payloads) have them,
for the tests that stand in for it with httpx.MockTransport."""

from __future__ import annotations

from typing import Any

from peer.formats.payloads import RunPublic

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
        "revocations_serial": None,
    }
    body.update(fields)
    RunPublic.model_validate(body)  # a stand-in that drifts from the contract fails here
    return body
