"""The bodies the coordinator's clients send: one description of each request for both sides.

The coordinator (``server``) declares these as its routes' request models, so FastAPI
validates and documents them with these very classes and their limits; the client
(:class:`peer.coordinator.CoordinatorClient`) builds its requests as these models. The
answers are in :mod:`peer.formats.payloads`.

- a volunteer's: :class:`JoinRequest`, :class:`ReachabilityRequest`, :class:`ReportCreate`
  (with the report's limits, :data:`MAX_INT` and :data:`MAX_ABS_LOSS`);
- an organizer's: :class:`RunCreate` (with its :class:`TaskFileCreate`), :class:`RunUpdate`,
  :class:`TokenCreate` (an invite), :class:`OrganizerTokenCreate`.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from peer.formats import task_files
from peer.formats.open_types import JsonObject
from peer.formats.payloads import RunStatus
from peer.formats.run_config import check_run_settings

__all__ = [
    "FAILURE_CHARACTERS",
    "MAX_ABS_LOSS",
    "MAX_CHALLENGE_LENGTH",
    "MAX_DISPLAY_NAME_LENGTH",
    "MAX_FAILURE_LENGTH",
    "MAX_INT",
    "MAX_MIN_VOLUNTEERS",
    "JoinRequest",
    "OrganizerTokenCreate",
    "Port",
    "ReachabilityRequest",
    "ReportCreate",
    "RunCreate",
    "RunUpdate",
    "TaskFileCreate",
    "TokenCreate",
    "decode_public_key",
    "decode_signature",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_json_config(value: JsonObject) -> JsonObject:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError as exc:
        raise ValueError("config must be JSON without NaN or Infinity") from exc
    return value


# PostgreSQL text cannot hold NUL; saying so in the schema tells clients as well.
NO_NUL = r"^[^\x00]*$"
Name = Annotated[str, Field(min_length=1, max_length=200, pattern=NO_NUL)]
Label = Annotated[str, Field(max_length=200, pattern=NO_NUL)]
# What a name may contain beyond this (no invisible characters) and when two are the same is
# the coordinator's to say (server.schemas.JoinRequest): a refused name is a 422 too.
MAX_DISPLAY_NAME_LENGTH = 64
DisplayName = Annotated[
    str, Field(min_length=1, max_length=MAX_DISPLAY_NAME_LENGTH, pattern=NO_NUL)
]
Address = Annotated[str, Field(min_length=1, max_length=256, pattern=NO_NUL)]
# The shared settings checked as every peer will check them (peer.formats.run_config); the
# task's own keys are checked by the organizer's CLI where it can load the task.
Config = Annotated[
    JsonObject, AfterValidator(_check_json_config), AfterValidator(check_run_settings)
]


# ----------------------------------------------------------------------- runs

# More volunteers than any run gathers: a bound, so a typo fails at once.
MAX_MIN_VOLUNTEERS = 1_000_000
MinVolunteers = Annotated[int, Field(ge=1, le=MAX_MIN_VOLUNTEERS)]


def _check_task_file(text: str) -> str:
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise ValueError("content must be the file's bytes, base64-encoded") from exc
    if not data:
        raise ValueError("the task file is empty")
    if len(data) > task_files.MAX_TASK_FILE_BYTES:
        raise ValueError(
            f"the task file is {len(data):,} bytes; at most "
            f"{task_files.MAX_TASK_FILE_BYTES:,} are shipped with a run"
        )
    return text


# The patterns are the schema's (clients see them); the validators say what is wrong.
Requirement = Annotated[
    str,
    AfterValidator(task_files.check_requirement),
    Field(
        json_schema_extra={
            "pattern": f"^{task_files.REQUIREMENT_PATTERN}$",
            "minLength": 1,
            "maxLength": task_files.MAX_REQUIREMENT_LENGTH,
        }
    ),
]


class TaskFileCreate(_Body):
    filename: Annotated[str, AfterValidator(task_files.check_filename)] = Field(
        description="The file's name, e.g. my_task.py; the run's task is my_task:function.",
        json_schema_extra={"pattern": f"^{task_files.FILENAME_PATTERN}$"},
    )
    content: Annotated[str, AfterValidator(_check_task_file)] = Field(
        description="The file's bytes, base64-encoded (standard alphabet), at most "
        f"{task_files.MAX_TASK_FILE_BYTES:,} bytes decoded.",
        json_schema_extra={
            "pattern": r"^(?:[A-Za-z0-9+/]{4})+$|^(?:[A-Za-z0-9+/]{4})*"
            r"(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)$",
            "maxLength": 4 * -(-task_files.MAX_TASK_FILE_BYTES // 3),
        },
    )
    requirements: list[Requirement] = Field(
        default_factory=list,
        max_length=task_files.MAX_REQUIREMENTS,
        description="pip requirements of the package index (numpy>=1.26), installed by each "
        "volunteer into a directory of the task's own.",
    )

    def data(self) -> bytes:
        """The file's bytes (``content`` decoded; validated above)."""
        return base64.b64decode(self.content)


class RunCreate(_Body):
    name: Name
    task: Name = Field(description="Name of the training task peers should run.")
    config: Config = Field(default_factory=dict, description="Hyper-parameters, as JSON.")
    min_volunteers: MinVolunteers | None = Field(
        default=None,
        description="Hold the run (status paused) until this many distinct volunteers are "
        "online; it then starts by itself. Without it the run starts at once.",
    )
    task_file: TaskFileCreate | None = Field(
        default=None,
        description="Ship this Python file with the run: task must then be module:function "
        "with module the file's name (my_task.py: my_task:make). Volunteers download it, "
        "check its SHA-256 and ask their owner's consent before running it.",
    )

    @model_validator(mode="after")
    def _task_names_the_file(self) -> RunCreate:
        if self.task_file is not None:
            module = self.task_file.filename[:-3]
            if self.task.partition(":")[0] != module or ":" not in self.task:
                raise ValueError(
                    f"with a task file the task is {module}:function, not {self.task!r}"
                )
            task_files.task_name(self.task_file.filename, self.task.partition(":")[2])
        return self


class RunUpdate(_Body):
    name: Name | None = None
    status: RunStatus | None = Field(
        default=None,
        description="running, paused or finished, by the organizer's hand: a run waiting "
        "for min_volunteers stops waiting (running starts it now).",
    )
    config: Config | None = None
    min_volunteers: MinVolunteers | None = Field(
        default=None,
        description="Hold the run until this many volunteers are online, then start it "
        "(at once if they are); null: stop waiting, and stay paused. With a status, the "
        "status applies first (a finished run cannot wait: 409).",
    )


# --------------------------------------------------------------------- tokens


class TokenCreate(_Body):
    expires_in_s: float | None = Field(
        None, gt=0, le=366 * 24 * 3600, description="Lifetime; default from the settings."
    )
    max_uses: int | None = Field(
        None, ge=1, le=10_000_000, description="How many may join; default from the settings."
    )
    label: Label | None = None


class OrganizerTokenCreate(_Body):
    label: Label | None = None
    expires_in_s: float | None = Field(
        None, gt=0, le=10 * 366 * 24 * 3600, description="Lifetime; without it, none."
    )


# -------------------------------------------------------------- joining a run

PUBLIC_KEY_PATTERN = r"^[A-Za-z0-9_-]{43}=?$"
SIGNATURE_PATTERN = r"^[A-Za-z0-9_-]{86}(==)?$"
CHALLENGE_PATTERN = r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$"
MAX_CHALLENGE_LENGTH = 256  # far more than the coordinator's challenges take


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


def decode_signature(text: str) -> bytes:
    """Raw 64 bytes of a urlsafe-base64 Ed25519 signature (padding optional)."""
    raw = base64.urlsafe_b64decode(text.rstrip("=").encode("ascii") + b"==")
    if len(raw) != 64:
        raise ValueError("signature must be a 64-byte Ed25519 signature, base64-encoded")
    return raw


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
        "peer.formats.identity.join_proof_payload(run_id, challenge, raw public key), urlsafe base64.",
    )
    addresses: list[Address] = Field(default_factory=list, max_length=16)
    client_mode: bool = Field(False, description="True for peers that accept no connections.")
    display_name: DisplayName | None = None

    @field_validator("public_key")
    @classmethod
    def _valid_key(cls, value: str) -> str:
        decode_public_key(value)
        return value


# --------------------------------------------------------------- reachability


Port = Annotated[int, Field(ge=1, le=65535)]


class ReachabilityRequest(_Body):
    port: Port = Field(description="The peer's WebSocket port.")
    bulk_port: Port | None = Field(None, description="Its bulk-transfer port, if it has one.")
    punch_port: Annotated[int, Field(ge=1024, le=65535)] | None = Field(
        None,
        description="The port it punches through its NAT from, if it does: when the "
        "coordinator cannot reach it, other peers are introduced to it at the address the "
        "request comes from and this port.",
    )


# ------------------------------------------------------------------ a progress report

MAX_INT = 2**53  # exact in a JSON double (browsers) and far inside a 64-bit column
# The largest loss or held-out metric, either way, that the coordinator takes as plausible: it
# refuses a report past it (422, counted against the peer), so a volunteer sends such a value
# (a diverging run) as unknown instead, the loss with ``loss_nan``.
MAX_ABS_LOSS = 1e6
MAX_FAILURE_LENGTH = 64
FAILURE_CHARACTERS = "A-Za-z0-9_.:-"  # a regular expression's character class


# One progress report of a peer (POST /runs/{run_id}/reports). The volunteer's side builds it
# with peer.coordinator.reports.clean_report; fields it leaves unset are not sent. (A comment,
# not a docstring: the OpenAPI document would carry a docstring as the schema's description.)
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
        max_length=MAX_FAILURE_LENGTH,
        pattern=rf"^[{FAILURE_CHARACTERS}]*$",
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
