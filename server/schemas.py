"""Request and response bodies of the REST API, kept apart from the ORM classes.

One family per resource: ``XCreate`` (what a client sends to create), ``XUpdate`` (partial
changes), ``XPublic`` (what the API returns). Those a client sends or reads are defined in
:mod:`peer.formats.requests` and :mod:`peer.formats.payloads` (one description for both
sides) and re-exported here, where the routes find every body (``JoinRequest`` with this
coordinator's check of display names added); the rest are the server's own.
"""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field

from peer.formats import requests as client_requests
from peer.formats.payloads import (
    BootstrapPeer,
    BootstrapPublic,
    CertificatePublic,
    CheckpointHeld,
    CheckpointPublic,
    CheckpointsPublic,
    EpochPublic,
    HistoryPoint,
    JoinChallengePublic,
    JoinResponse,
    OrganizerTokenCreated,
    OrganizerTokenPublic,
    OrganizerTokensPublic,
    ProgressPublic,
    ReachabilityPublic,
    RendezvousPeer,
    RendezvousPublic,
    RevocationsPublic,
    RunPublic,
    RunsPublic,
    RunStatus,
    TaskFilePublic,
    TokenCreated,
)
from peer.formats.requests import (
    MAX_INT,
    OrganizerTokenCreate,
    Port,
    ReachabilityRequest,
    ReportCreate,
    RunCreate,
    RunUpdate,
    TaskFileCreate,
    TokenCreate,
    decode_public_key,
    decode_signature,
)
from server.services import display_names

__all__ = [
    "MAX_INT",
    "BootstrapPeer",
    "BootstrapPublic",
    "CertificatePublic",
    "CheckpointHeld",
    "CheckpointPublic",
    "CheckpointsPublic",
    "EpochPublic",
    "ErrorPublic",
    "HealthPublic",
    "HistoryPoint",
    "JoinChallengePublic",
    "JoinRequest",
    "JoinResponse",
    "OrganizerTokenCreate",
    "OrganizerTokenCreated",
    "OrganizerTokenPublic",
    "OrganizerTokensPublic",
    "PeerPublic",
    "PeersPublic",
    "Port",
    "ProgressPublic",
    "ReachabilityPublic",
    "ReachabilityRequest",
    "RendezvousPeer",
    "RendezvousPublic",
    "ReportAccepted",
    "ReportCreate",
    "RevocationsPublic",
    "RunCreate",
    "RunPublic",
    "RunStatus",
    "RunUpdate",
    "RunsPublic",
    "TaskFileCreate",
    "TaskFilePublic",
    "TokenCreate",
    "TokenCreated",
    "TokenPublic",
    "TokensPublic",
    "decode_public_key",
    "decode_signature",
    "encode_bytes",
]


def encode_bytes(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


class ErrorPublic(BaseModel):
    detail: Any = Field(description="What went wrong and, where possible, what to do next.")


# --------------------------------------------------------------------------- tokens


class TokenPublic(BaseModel):
    id: str
    label: str | None
    created_at: datetime
    expires_at: datetime | None
    max_uses: int | None
    uses: int
    revoked_at: datetime | None
    active: bool


class TokensPublic(BaseModel):
    tokens: list[TokenPublic]


# --------------------------------------------------------------------------- peers

# Refused as the schema says (422 naming the field) rather than in the route: a name with an
# invisible character (server.services.display_names) is a bad request like any other.
DisplayName = Annotated[client_requests.DisplayName, AfterValidator(display_names.clean)]


class JoinRequest(client_requests.JoinRequest):
    # The client's request, its display name checked as this coordinator shows names.
    display_name: DisplayName | None = None


class PeerPublic(BaseModel):
    peer_id: str
    display_name: str
    addresses: list[str]
    client_mode: bool
    online: bool
    first_seen_at: datetime
    last_seen_at: datetime
    last_report_at: datetime | None
    epoch: int
    samples: int
    samples_per_second: float = Field(
        description="What the peer's latest report claims it computes (its own measure, "
        "time spent averaging left out); the run's counted rate is on its progress."
    )
    loss: float | None
    eval_metric: float | None = Field(
        None, description="The held-out metric of the peer's latest report that had one."
    )
    reports_refused: int = Field(
        description="Reports refused for breaking a plausibility bound (422)."
    )
    last_refusal: str | None = Field(
        description="The bound the last refused report broke: samples_per_second, samples, "
        "rounds, loss, eval_metric, group_size or epoch."
    )
    last_refusal_at: datetime | None


class PeersPublic(BaseModel):
    peers: list[PeerPublic]


# --------------------------------------------------------------------------- progress


class ReportAccepted(BaseModel):
    status: Literal["accepted"] = "accepted"


class HealthPublic(BaseModel):
    status: Literal["ok"] = "ok"
    database: Literal["ok"] = "ok"
