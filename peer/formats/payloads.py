"""The coordinator's answers that its clients read (a volunteer's peer and the organizer's
``swarmgrad`` commands): one description of each answer for both sides.

The coordinator (``server``) declares them as its routes' response models, so FastAPI
documents them with these very classes; the client (:class:`peer.coordinator.CoordinatorClient`)
parses every answer into them before it uses a field, so an answer of another shape is
refused as not a coordinator's, naming the field, and mypy checks both sides' uses against
one set of types. The requests are in :mod:`peer.formats.requests`; the server's own bodies
(its web pages', its dashboard API's) stay in ``server.schemas``, which re-exports both.
"""

from __future__ import annotations

import enum
from datetime import datetime

from pydantic import BaseModel, Field

from peer.formats.open_types import JsonObject

__all__ = [
    "BootstrapPeer",
    "BootstrapPublic",
    "CertificatePublic",
    "CheckpointHeld",
    "CheckpointPublic",
    "CheckpointsPublic",
    "EpochPublic",
    "HistoryPoint",
    "JoinChallengePublic",
    "JoinResponse",
    "OrganizerTokenCreated",
    "OrganizerTokenPublic",
    "OrganizerTokensPublic",
    "ProgressPublic",
    "ReachabilityPublic",
    "RendezvousPeer",
    "RendezvousPublic",
    "RevocationsPublic",
    "RunPublic",
    "RunStatus",
    "RunsPublic",
    "TaskFilePublic",
    "TokenCreated",
]


class RunStatus(enum.StrEnum):
    """A run's status: peers train while it is running, wait while it is paused, and leave
    once it is finished."""

    running = "running"
    paused = "paused"
    finished = "finished"


# ----------------------------------------------------------------------- runs


class TaskFilePublic(BaseModel):
    """The task file a run ships to its volunteers (``GET /runs/{run_id}/task``)."""

    filename: str = Field(description="The file's name: the run's task names its module.")
    sha256: str = Field(description="SHA-256 of the file's bytes (hex): what volunteers check.")
    size: int = Field(description="The file's size in bytes.")
    requirements: list[str] = Field(
        default_factory=list,
        description="pip requirements a volunteer installs for it, into a directory of the "
        "task's own.",
    )


class RunPublic(BaseModel):
    id: str
    name: str
    task: str
    config: JsonObject
    status: RunStatus
    created_at: datetime
    updated_at: datetime
    archived_at: datetime | None
    public_key: str = Field(description="The run authority's Ed25519 public key (base64).")
    min_volunteers: int | None = Field(
        None,
        description="While set, the run waits (status paused) until this many volunteers "
        "are online, then starts by itself; null once it started, or when it never waited.",
    )
    volunteers_online: int | None = Field(
        None,
        description="While the run waits for min_volunteers: the distinct volunteers online "
        "and ready, i.e. reported once their task and model were loaded (a volunteer's "
        "machines count once). Null otherwise.",
    )
    finished_at_epoch: int | None = Field(
        None,
        description="The last epoch (config epochs), when the run finished by itself on "
        "reaching it; null when the organizer finished it, or while it runs.",
    )
    status_detail: str | None = Field(
        None,
        description="Why the run is in its status, for people: 'waiting for 3 volunteers "
        "(1 online)', 'reached its last epoch 40'; null for the organizer's own pause, "
        "resume or finish.",
    )
    task_file: TaskFilePublic | None = Field(
        None,
        description="The task file the run ships (its task is module:function of it): "
        "volunteers download it, check its SHA-256 and install its requirements; null "
        "when the task is installed on the volunteers' machines.",
    )
    revocations_serial: int | None = Field(
        None,
        description="Serial of the run's revocation list (its newest ban, in ms; 0 without "
        "bans): a peer fetches GET /runs/{run_id}/revocations when it grows. Only on a "
        "single run's answer.",
    )


class RevocationsPublic(BaseModel):
    serial: int = Field(description="Grows with every ban; a peer keeps the highest it saw.")
    list: str = Field(
        description="The signed list (base64 of msgpack [run_id, serial, [[public_key, "
        "until], ...], signature]); peers check the run authority's signature themselves."
    )


class RunsPublic(BaseModel):
    runs: list[RunPublic]


# --------------------------------------------------------------------- tokens


class TokenCreated(BaseModel):
    id: str
    token: str = Field(description="The join token. Shown only now; store it safely.")
    expires_at: datetime | None
    max_uses: int | None
    label: str | None


class OrganizerTokenCreated(BaseModel):
    id: str
    token: str = Field(description="The organizer token. Shown only now; store it safely.")
    label: str | None
    expires_at: datetime | None


class OrganizerTokenPublic(BaseModel):
    id: str
    label: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    active: bool
    current: bool = Field(description="This is the token of the request.")


class OrganizerTokensPublic(BaseModel):
    tokens: list[OrganizerTokenPublic] = Field(description="Oldest first.")


# ---------------------------------------------------------------- checkpoints


class CheckpointPublic(BaseModel):
    epoch: int
    size: int = Field(description="Bytes.")
    sha256: str = Field(description="Hex SHA-256 of the file.")
    created_at: datetime
    peer_id: str = Field(description="The peer that uploaded it.")
    pinned: bool = Field(
        False, description="Pinned by the organizer: served instead of the newest."
    )


class CheckpointHeld(BaseModel):
    epoch: int
    detail: str = Field(description="Why only the digest was kept.")


class CheckpointsPublic(BaseModel):
    checkpoints: list[CheckpointPublic] = Field(description="Newest first.")


# -------------------------------------------------------------------- progress


class HistoryPoint(BaseModel):
    t: datetime
    epoch: int
    samples: int
    samples_per_second: float
    loss: float | None
    peers_online: int
    eval_metric: float | None = None
    mean_group_size: float | None = None
    rounds_done: int = 0
    rounds_failed: int = 0


class EpochPublic(BaseModel):
    epoch: int
    started_at: datetime
    last_report_at: datetime
    reports: int
    mean_loss: float | None
    max_group_size: int | None
    rounds_done: int
    rounds_failed: int


class ProgressPublic(BaseModel):
    run_id: str
    status: RunStatus
    epoch: int
    samples: int
    samples_per_second: float = Field(
        description="How fast the run's samples counter grew over the last 10-15 s of the "
        "coordinator's clock: counted, not claimed."
    )
    compute_samples_per_second: float = Field(
        0.0,
        description="What the online peers say they compute, summed (time spent averaging "
        "excluded): their claim, for comparison.",
    )
    peers_online: int
    loss: float | None = Field(description="Median of the online peers' latest losses.")
    eval_metric: float | None = Field(
        description="Median of the held-out metrics the online peers reported within the "
        "online TTL; else the latest reported."
    )
    rounds_done: int = Field(description="Averaging rounds completed, summed over peers.")
    rounds_failed: int = Field(description="Averaging rounds failed, summed over peers.")
    bytes_per_sample: float | None = Field(
        None,
        description="Bytes the peers' nodes sent per sample they trained, over the peers "
        "that report it (their claims, summed); None before any does.",
    )
    checkpoint: CheckpointPublic | None = Field(description="The newest checkpoint.")
    recent_group_sizes: list[int]
    epochs: list[EpochPublic] = Field(description="The most recent epochs, newest last.")
    history: list[HistoryPoint] = Field(description="Downsampled history, oldest first.")


# -------------------------------------------------------------- joining a run


class JoinChallengePublic(BaseModel):
    run_id: str
    run_name: str
    task: str
    status: RunStatus
    challenge: str = Field(description="Sign join_proof_payload(run_id, challenge, public_key).")
    expires_at: datetime


class BootstrapPeer(BaseModel):
    peer_id: str
    addresses: list[str]


# How often a volunteer reports its progress unless its coordinator says otherwise at join:
# 10,000 volunteers then make 1,000 reports a second.
DEFAULT_REPORT_INTERVAL_S = 10.0


class JoinResponse(BaseModel):
    run_id: str
    peer_id: str
    peer_token: str = Field(description="Bearer token for this peer's later calls.")
    certificate: str = Field(description="Run certificate (base64) for the peer library.")
    certificate_expires_at: datetime
    run_public_key: str
    run_name: str
    status: RunStatus
    task: str
    config: JsonObject
    bootstrap: list[BootstrapPeer]
    checkpoint: CheckpointPublic | None = Field(
        description="The run's newest checkpoint, to start from (GET /runs/{id}/checkpoint)."
    )
    report_interval_s: float = Field(
        default=DEFAULT_REPORT_INTERVAL_S,
        ge=1.0,
        le=60.0,
        description="How often the peer reports its progress (a coordinator that does not say "
        "expects every 10 s).",
    )
    relays: list[str] = Field(
        default_factory=list,
        description="Relays (relay://host:port) to register with when no other peer can "
        "dial this one: pairs that cannot punch through their NATs link through them.",
    )


class CertificatePublic(BaseModel):
    certificate: str
    certificate_expires_at: datetime


class BootstrapPublic(BaseModel):
    peers: list[BootstrapPeer]


# --------------------------------------------------------------- reachability


class ReachabilityPublic(BaseModel):
    reachable: bool
    address: str | None = Field(description="The address now announced for the peer, if any.")
    host: str = Field(description="The peer's address as the coordinator sees it.")
    port: int
    bulk_port: int | None
    detail: str = Field(description="One line for the volunteer.")
    punch_address: str | None = Field(
        None,
        description="Where other peers punch toward it (``punch://host:port/<peer id>``) "
        "when it is not reachable but punches.",
    )


class RendezvousPeer(BaseModel):
    """A peer behind a NAT that others may punch toward: its public address as the
    coordinator saw it, and the port it punches from."""

    peer_id: str
    host: str
    port: int
    relays: list[str] = Field(
        default_factory=list,
        description="Where it is reached through the coordinator's relays "
        "(relay://host:port/<peer id>), for a pair the punch does not get through.",
    )


class RendezvousPublic(BaseModel):
    peers: list[RendezvousPeer]
