"""What the dashboard pages and their live updates carry: one JSON document per view.

Numbers that can be missing are null (never NaN: JSON has none). Series are parallel arrays,
oldest first, with times in Unix seconds (what the charts take)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from server.models import RunStatus


class RunRow(BaseModel):
    id: str
    name: str
    status: RunStatus
    status_detail: str | None = Field(
        None, description="Why it is in its status: 'waiting for 3 volunteers (1 online)'."
    )
    task: str
    epoch: int
    samples: int
    peers_online: int
    samples_per_second: float = Field(
        description="The run's samples counter's growth on the coordinator's clock."
    )
    compute_samples_per_second: float = Field(
        0.0, description="What the online peers claim to compute, summed."
    )
    trend: list[float] = Field(description="Recent samples/s, oldest first.")


class RunsOverview(BaseModel):
    runs: list[RunRow]
    version: str


class RunHeader(BaseModel):
    id: str
    name: str
    task: str
    status: RunStatus
    status_detail: str | None = Field(
        None,
        description="Why it is in its status: 'waiting for 3 volunteers (1 online)', "
        "'reached its last epoch 40'; null for the organizer's own pause or finish.",
    )
    created_at: datetime
    target_epochs: int | None
    algorithm: str = Field(
        "collaborative",
        description="How its peers train: collaborative, or diloco (an epoch is an outer round).",
    )


class CheckpointSummary(BaseModel):
    epoch: int
    created_at: datetime
    age_s: float
    size: int
    sha256: str


class Headline(BaseModel):
    epoch: int
    samples: int
    samples_per_second: float = Field(
        description="The run's samples counter's growth on the coordinator's clock."
    )
    compute_samples_per_second: float = Field(
        0.0, description="What the online peers claim to compute, summed: their claim."
    )
    peers_online: int
    loss: float | None
    eval_metric: float | None
    rounds_done: int
    rounds_failed: int
    bytes_per_sample: float | None = Field(
        None, description="Bytes the peers claim their nodes sent per sample they trained."
    )
    eta_s: float | None = Field(
        description="Estimated seconds to the run's target epoch at the pace of its recent "
        "epochs (paused time left out); null without a target, before two epochs, or while "
        "a running run has no volunteer online."
    )
    checkpoint: CheckpointSummary | None


class Alert(BaseModel):
    kind: Literal[
        "loss_nan",
        "loss_jump",
        "peers_collapse",
        "rounds_failing",
        "stalled",
        "not_averaging",
        "no_group",
        "islands",
    ]
    severity: Literal["warning", "critical"]
    message: str
    help: str | None = Field(default=None, description="What would help, where the alert knows.")


class Series(BaseModel):
    t: list[float] = []
    samples: list[int] = []
    samples_per_second: list[float] = []
    peers_online: list[int] = []
    loss: list[float | None] = []
    eval_metric: list[float | None] = []
    mean_group_size: list[float | None] = []
    rounds_done: list[int] = []
    rounds_failed: list[int] = []


class GroupSizeCount(BaseModel):
    size: int
    count: int


class GroupSizes(BaseModel):
    recent: list[int] = Field(description="Group sizes of the last reports, oldest first.")
    histogram: list[GroupSizeCount]


class VolunteerRow(BaseModel):
    id: int
    display_name: str
    samples: int
    share: float = Field(description="Fraction of the run's samples.")
    online_s: float
    last_seen: datetime | None
    online: bool
    reachable: bool = Field(description="True: the coordinator reached a machine of theirs.")
    behind_nat: bool = Field(
        False,
        description="True: not reachable, but a machine of theirs behind a NAT takes part "
        "by hole punching (and relays); False with reachable false: client mode only.",
    )
    peers: int
    banned: bool


VolunteerSort = Literal["samples", "share", "display_name", "online_s", "last_seen", "reachable"]


class VolunteerPageInfo(BaseModel):
    """Which page of the volunteers' table a document carries, and how many there are."""

    page: int = Field(description="1-based; past the last page, the last page is sent.")
    per_page: int
    pages: int = Field(description="Pages of volunteers that match the filter (at least 1).")
    matching: int = Field(description="Volunteers that match the filter.")
    total: int = Field(description="Volunteers of the run, whatever the filter.")
    online: int = Field(description="Volunteers of the run with a machine online.")
    sort: VolunteerSort
    order: Literal["asc", "desc"]
    q: str = Field(description="The filter: part of a display name, any case ('' for none).")


class VolunteerPage(BaseModel):
    """One page of a run's volunteers' table, sorted and filtered by the coordinator."""

    now: datetime
    volunteers_page: VolunteerPageInfo
    volunteers: list[VolunteerRow]


class RunDashboard(BaseModel):
    run: RunHeader
    now: datetime
    version: str
    headline: Headline
    alerts: list[Alert]
    series: Series
    group_sizes: GroupSizes
    volunteers_page: VolunteerPageInfo
    volunteers: list[VolunteerRow] = Field(description="One page: see volunteers_page.")


class VolunteerSummary(BaseModel):
    id: int
    display_name: str
    samples: int
    share: float
    rank: int
    of: int
    online_s: float
    first_seen: datetime | None
    last_seen: datetime | None
    banned: bool


class SessionRow(BaseModel):
    peer_id: str
    started: datetime
    ended: datetime | None = Field(description="Null while the session goes on.")
    duration_s: float


class MachineRow(BaseModel):
    peer_id: str
    addresses: list[str]
    reachable: bool
    behind_nat: bool = Field(
        False, description="Behind a NAT, reached by hole punching (a punch:// address)."
    )
    client_mode: bool
    epoch: int
    samples: int
    samples_per_second: float = Field(
        description="This machine's samples counter's growth on the coordinator's clock."
    )
    compute_samples_per_second: float = Field(
        0.0, description="What this machine claims to compute (its own measure)."
    )
    compute_utilisation: float | None = Field(
        None,
        description="The share of its training loop's time this machine claims it spent "
        "computing rather than waiting on the swarm, at its latest report.",
    )
    group_size: int | None
    last_seen: datetime
    online: bool


class VolunteerSeries(BaseModel):
    t: list[float]
    samples: list[int]


class RunRef(BaseModel):
    id: str
    name: str


class VolunteerDetail(BaseModel):
    run: RunRef
    volunteer: VolunteerSummary
    series: VolunteerSeries
    sessions: list[SessionRow]
    machines: list[MachineRow]


class VolunteerBanned(BaseModel):
    id: int
    display_name: str
    banned: bool
    invites: list[str] = Field(
        default_factory=list,
        description="Ids of the invites the volunteer came through: revoke them "
        "(revoke_invites=true, or DELETE /runs/{id}/tokens/{token_id}) so the banned person "
        "cannot come back with a new key.",
    )
    invites_revoked: list[str] = Field(default_factory=list, description="Those this call revoked.")
