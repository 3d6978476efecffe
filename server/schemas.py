"""Request and response bodies of the REST API, kept apart from the ORM classes.

One family per resource: ``XCreate`` (what a client sends to create), ``XUpdate`` (partial
changes), ``XPublic`` (what the API returns). Those the volunteer's side reads or sends are
defined in :mod:`peer.formats.payloads` (one description for both sides) and re-exported.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

# The payloads the volunteer's side reads or sends live in the module both sides import;
# re-exported here, where the routes find every body.
from peer.formats.payloads import (
    BootstrapPeer as BootstrapPeer,
)
from peer.formats.payloads import (
    BootstrapPublic as BootstrapPublic,
)
from peer.formats.payloads import (
    CertificatePublic as CertificatePublic,
)
from peer.formats.payloads import (
    CheckpointHeld as CheckpointHeld,
)
from peer.formats.payloads import (
    CheckpointPublic as CheckpointPublic,
)
from peer.formats.payloads import (
    CheckpointsPublic as CheckpointsPublic,
)
from peer.formats.payloads import (
    EpochPublic as EpochPublic,
)
from peer.formats.payloads import (
    HistoryPoint as HistoryPoint,
)
from peer.formats.payloads import (
    JoinChallengePublic as JoinChallengePublic,
)
from peer.formats.payloads import (
    JoinResponse as JoinResponse,
)
from peer.formats.payloads import (
    OrganizerTokenCreated as OrganizerTokenCreated,
)
from peer.formats.payloads import (
    OrganizerTokenPublic as OrganizerTokenPublic,
)
from peer.formats.payloads import (
    OrganizerTokensPublic as OrganizerTokensPublic,
)
from peer.formats.payloads import (
    Port as Port,
)
from peer.formats.payloads import (
    ProgressPublic as ProgressPublic,
)
from peer.formats.payloads import (
    ReachabilityPublic as ReachabilityPublic,
)
from peer.formats.payloads import (
    ReachabilityRequest as ReachabilityRequest,
)
from peer.formats.payloads import (
    RevocationsPublic as RevocationsPublic,
)
from peer.formats.payloads import (
    RunPublic as RunPublic,
)
from peer.formats.payloads import (
    RunsPublic as RunsPublic,
)
from peer.formats.payloads import (
    RunStatus as RunStatus,
)
from peer.formats.payloads import (
    TokenCreated as TokenCreated,
)
from server.security import MAX_CHALLENGE_LENGTH

MAX_INT = 2**53  # exact in a JSON double (browsers) and far inside a 64-bit column


def _check_json_config(value: dict[str, Any]) -> dict[str, Any]:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError as exc:
        raise ValueError("config must be JSON without NaN or Infinity") from exc
    return value


# PostgreSQL text cannot hold NUL; saying so in the schema tells clients as well.
NO_NUL = r"^[^\x00]*$"
Name = Annotated[str, Field(min_length=1, max_length=200, pattern=NO_NUL)]
Label = Annotated[str, Field(max_length=200, pattern=NO_NUL)]
DisplayName = Annotated[str, Field(min_length=1, max_length=64, pattern=NO_NUL)]
Address = Annotated[str, Field(min_length=1, max_length=256, pattern=NO_NUL)]
Config = Annotated[dict[str, Any], AfterValidator(_check_json_config)]


PUBLIC_KEY_PATTERN = r"^[A-Za-z0-9_-]{43}=?$"


def decode_public_key(text: str) -> bytes:
    """Raw 32 bytes of a urlsafe-base64 Ed25519 public key (padding optional);
    ``ValueError`` otherwise."""
    try:
        raw = base64.urlsafe_b64decode(text.rstrip("=").encode("ascii") + b"=")
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise ValueError("public_key must be urlsafe base64") from exc
    if len(raw) != 32:
        raise ValueError("public_key must be a 32-byte Ed25519 public key, base64-encoded")
    return raw


SIGNATURE_PATTERN = r"^[A-Za-z0-9_-]{86}(==)?$"
CHALLENGE_PATTERN = r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$"


def decode_signature(text: str) -> bytes:
    """Raw 64 bytes of a urlsafe-base64 Ed25519 signature (padding optional)."""
    raw = base64.urlsafe_b64decode(text.rstrip("=").encode("ascii") + b"==")
    if len(raw) != 64:
        raise ValueError("signature must be a 64-byte Ed25519 signature, base64-encoded")
    return raw


def encode_bytes(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorPublic(BaseModel):
    detail: Any = Field(description="What went wrong and, where possible, what to do next.")


# --------------------------------------------------------------------------- runs


class RunCreate(_Body):
    name: Name
    task: Name = Field(description="Name of the training task peers should run.")
    config: Config = Field(default_factory=dict, description="Hyper-parameters, as JSON.")


class RunUpdate(_Body):
    name: Name | None = None
    status: RunStatus | None = None
    config: Config | None = None


# --------------------------------------------------------------------------- tokens


class TokenCreate(_Body):
    expires_in_s: float | None = Field(
        None, gt=0, le=366 * 24 * 3600, description="Lifetime; default from the settings."
    )
    max_uses: int | None = Field(
        None, ge=1, le=10_000_000, description="How many may join; default from the settings."
    )
    label: Label | None = None


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


class OrganizerTokenCreate(_Body):
    label: Label | None = None
    expires_in_s: float | None = Field(
        None, gt=0, le=10 * 366 * 24 * 3600, description="Lifetime; without it, none."
    )


# --------------------------------------------------------------------------- peers


class JoinRequest(_Body):
    public_key: str = Field(
        pattern=PUBLIC_KEY_PATTERN,
        description="The peer's 32-byte Ed25519 public key, urlsafe base64.",
    )
    challenge: str = Field(
        max_length=MAX_CHALLENGE_LENGTH,
        pattern=CHALLENGE_PATTERN,
        description="From POST /api/v1/join/challenge with the same join token.",
    )
    signature: str = Field(
        pattern=SIGNATURE_PATTERN,
        description="Ed25519 signature by the peer's key of "
        "peer.identity.join_proof_payload(run_id, challenge, raw public key), urlsafe base64.",
    )
    addresses: list[Address] = Field(default_factory=list, max_length=16)
    client_mode: bool = Field(False, description="True for peers that accept no connections.")
    display_name: DisplayName | None = None

    @field_validator("public_key")
    @classmethod
    def _valid_key(cls, value: str) -> str:
        decode_public_key(value)
        return value


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


class ReportCreate(_Body):
    epoch: int = Field(ge=0, le=MAX_INT)
    samples: int = Field(
        ge=0, le=MAX_INT, description="Samples this peer has processed since it joined."
    )
    samples_per_second: float = Field(ge=0, le=1e12, allow_inf_nan=False)
    loss: float | None = Field(None, allow_inf_nan=False, ge=-1e300, le=1e300)
    loss_nan: bool = Field(
        False, description="The loss was NaN or infinite (send loss null): dashboards alert."
    )
    group_size: int | None = Field(None, ge=1, le=1_000_000)
    rounds_done: int = Field(0, ge=0, le=MAX_INT, description="Since the previous report.")
    rounds_failed: int = Field(0, ge=0, le=MAX_INT, description="Since the previous report.")
    failure: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.:-]*$",
        description="Why the last failed round failed (the error's class name).",
    )
    eval_metric: float | None = Field(
        None,
        allow_inf_nan=False,
        ge=-1e300,
        le=1e300,
        description="The task's metric on held-out data, when the peer evaluated.",
    )
    bytes_sent: int | None = Field(
        None,
        ge=0,
        le=MAX_INT,
        description="Bytes this peer's node has sent since it started (the counter behind "
        "`samples`): a claim, shown as bytes per sample.",
    )
    compute_utilisation: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="The share of its training loop's time this peer spent computing rather "
        "than waiting on the swarm, since its previous report: a claim.",
    )


class ReportAccepted(BaseModel):
    status: Literal["accepted"] = "accepted"


class HealthPublic(BaseModel):
    status: Literal["ok"] = "ok"
    database: Literal["ok"] = "ok"
