"""Point 5: a property-based run over the OpenAPI schema (Schemathesis) finds no 5xx and no
response that breaks the schema, with valid credentials for each endpoint's scope, against
a real run, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import positive_data_acceptance

from peer.formats.identity import Identity
from server.app import create_app
from server.db import upgrade_database
from server.models import TokenScope
from server.schemas import JoinRequest, RunCreate, TaskFileCreate, TokenCreate
from server.security import JoinChallenges, KeyBox
from server.services import peers as peer_service
from server.services import runs as run_service
from server.services import tokens as token_service
from tests.server.conftest import ADMIN_TOKEN, SECRET_KEY, join_proof, make_settings

# A fixed, modest run by default (deterministic, ~12 s per backend); set FUZZ_EXAMPLES to
# explore further with fresh random seeds.
MAX_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
DERANDOMIZE = "FUZZ_EXAMPLES" not in os.environ


class Credentials:
    """A fresh run with a join token and a joined peer, made directly through the services."""

    def __init__(self, app) -> None:  # type: ignore[no-untyped-def]
        self._factory = app.state.session_factory
        self._keybox = KeyBox(SECRET_KEY)
        self._challenges = JoinChallenges(SECRET_KEY, ttl_s=120)

    def fresh(self) -> dict[str, str]:
        with self._factory() as session, session.begin():
            # a run that ships its task file: its download is one of the operations
            shipped = TaskFileCreate(filename="t.py", content="ZGVmIHQoKTogcGFzcwo=")
            body = RunCreate(name="fuzz", task="t:t", task_file=shipped)
            run = run_service.create_run(session, self._keybox, body)
            _, join = token_service.create_join_token(session, run, TokenCreate(), 3600, 100)
            join_id = join.split("_")[1]
            challenge = self._challenges.issue(run.id, join_id).text
            joined = peer_service.join(
                session,
                self._keybox,
                self._challenges,
                run,
                join_id,
                JoinRequest(**join_proof(run.id, challenge, Identity()), addresses=["ws://x:1"]),
                certificate_ttl_s=3600,
                peer_token_ttl_s=3600,
                online_ttl_s=60,
                bootstrap_size=8,
            )
            return {
                "run_id": run.id,
                "volunteer_id": str(joined.peer.volunteer_id),
                TokenScope.join: join,
                TokenScope.peer: joined.peer_token,
            }


@pytest.fixture
def fuzzed_app(database_url: str, tmp_path: Path) -> Iterator[object]:
    settings = make_settings(
        database_url,
        report_flush_interval_s=0,
        checkpoint_dir=tmp_path / "checkpoints",
        # Thousands of requests from one client: the limits (tested on their own in
        # test_rate_limits.py) would answer 429 before the token checks this fuzzes.
        rate_limits=False,
    )
    app = create_app(settings)
    upgrade_database(app.state.engine)
    yield app
    asgi.shutdown_lifespans()


def _scope(method: str, path: str) -> TokenScope | None:
    if path.endswith(("/join", "/join/challenge", "/task")):  # the task: read before joining
        return TokenScope.join
    if path.endswith(
        ("/bootstrap", "/certificate", "/reports", "/reachability", "/leave", "/rendezvous")
    ):
        return TokenScope.peer
    if path.endswith("/checkpoint"):
        return TokenScope.peer
    if method == "GET" and not path.endswith(("/tokens", "/peers", "/checkpoints")):
        return None  # public reads
    return TokenScope.organizer


def test_api_conforms_to_its_schema(fuzzed_app) -> None:  # type: ignore[no-untyped-def]
    """Every operation, ``MAX_EXAMPLES`` generated cases each. (Schemathesis' pytest
    plugin is not used: its lazy fixture mode does not work with this pytest.)"""
    credentials = Credentials(fuzzed_app)
    api_schema = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 14
    statuses: dict[str, set[int]] = {}

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=DERANDOMIZE,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:  # type: ignore[no-untyped-def]
            made = credentials.fresh()
            if "run_id" in (case.path_parameters or {}):
                case.path_parameters["run_id"] = made["run_id"]
            for name in ("volunteer_id", "ref"):  # the run's one volunteer
                if name in (case.path_parameters or {}):
                    case.path_parameters[name] = made["volunteer_id"]
            scope = _scope(case.method.upper(), case.path)
            headers = {}
            if scope is TokenScope.organizer:
                headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
            elif scope is not None:
                headers["Authorization"] = f"Bearer {made[scope]}"
            # A checkpoint is a zip archive, a report must be plausible (a rate under the
            # coordinator's limit, an epoch near the swarm's), and a display name visible (no
            # invisible or unassigned characters, server.services.display_names), which the
            # schema cannot say: generated bodies are refused (422) though they fit it. So is a
            # run whose task does not name its task file's module.
            refusable = case.method.upper() == "PUT" or case.path.endswith(("/reports", "/join"))
            refusable |= isinstance(case.body, dict) and "task_file" in case.body
            excluded = [positive_data_acceptance] if refusable else []
            response = case.call_and_validate(headers=headers, excluded_checks=excluded)
            statuses.setdefault(case.operation.label, set()).add(response.status_code)
            if 400 <= response.status_code < 500:  # every refusal says why, in JSON
                body = response.json()
                assert isinstance(body, dict) and body.get("detail"), (case.path, body)

        check()

    # The run was real and the credentials right, so every operation must have succeeded at
    # least once, except those no generated input can satisfy: revoking a random token id
    # (always unknown), joining (needs a signature over a fresh challenge), uploading a
    # checkpoint (needs a zip archive), and downloading, pinning or deleting one (needs an
    # upload first).
    impossible = ("{token_id}", "/join", "/checkpoint", "/checkpoints/{epoch}", "{epoch}/pin")
    never_succeeded = {
        label
        for label, seen in statuses.items()
        if not any(200 <= s < 300 for s in seen) and not label.endswith(impossible)
    }
    assert never_succeeded == set(), statuses
