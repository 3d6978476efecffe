"""``CoordinatorClient``: the coordinator's REST API, as a volunteer and an organizer see it.

One synchronous ``httpx.Client`` underneath (safe to share between threads). Every answer
must carry the ``X-Swarmgrad-Coordinator`` header, so that a captive portal or another
service at the URL is reported as such instead of as a puzzling error. Every answer is
parsed into its type of :mod:`peer.formats.payloads` — the classes the coordinator's routes
validate with — before a field is read; one of another shape is :class:`NotACoordinator`,
naming the field. The organizer's calls return those payloads themselves (``RunPublic``,
``ProgressPublic``, ``CheckpointPublic``, ...; ``model_dump(mode="json")`` is what ``--json``
prints), so mypy checks every use of a field against the coordinator's own description of it.
Every failure is a :class:`~peer.coordinator.exceptions.CoordinatorError` with a one-line
message; httpx's own errors never escape.

A volunteer's calls, in order: :meth:`~CoordinatorClient.join_challenge` (names the run and
its task), :meth:`~CoordinatorClient.join` (proves the peer holds its key; returns a peer
token and a run certificate), :meth:`~CoordinatorClient.check_reachability`, then, while
training, :meth:`~CoordinatorClient.report`, :meth:`~CoordinatorClient.renew_certificate`,
:meth:`~CoordinatorClient.bootstrap` and the checkpoint calls — usually through a
:class:`~peer.coordinator.session.CoordinatorSession`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
from pydantic import BaseModel, ValidationError

from peer.coordinator.exceptions import (
    CoordinatorFailed,
    CoordinatorUnreachable,
    NotACoordinator,
    NotFound,
)
from peer.coordinator.responses import error_from, reason
from peer.formats.identity import Identity, join_proof_payload
from peer.formats.payloads import (
    DEFAULT_REPORT_INTERVAL_S,
    BootstrapPeer,
    BootstrapPublic,
    CertificatePublic,
    CheckpointHeld,
    CheckpointPublic,
    CheckpointsPublic,
    JoinChallengePublic,
    JoinResponse,
    OrganizerTokenCreated,
    OrganizerTokenPublic,
    OrganizerTokensPublic,
    ProgressPublic,
    ReachabilityPublic,
    ReachabilityRequest,
    RevocationsPublic,
    RunPublic,
    RunsPublic,
    RunStatus,
    TokenCreated,
)

API_PREFIX = "/api/v1"
COORDINATOR_HEADER = "X-Swarmgrad-Coordinator"

_M = TypeVar("_M", bound=BaseModel)

_GATEWAY_DOWN = frozenset({502, 503, 504})
_TOKEN_CHARS = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces


# --------------------------------------------------------------------------- answers


@dataclass(frozen=True, slots=True)
class JoinChallenge:
    """What ``POST /join/challenge`` answers: the run a join token is for, and a challenge
    to sign before it expires (``expires_at``, Unix seconds)."""

    run_id: str
    run_name: str
    task: str
    status: str
    challenge: str = field(repr=False)
    expires_at: float


@dataclass(frozen=True, slots=True)
class JoinAnswer:
    """A joined peer's credentials and starting point.

    ``peer_token`` authenticates the peer's later calls; ``certificate`` (base64, for
    ``Certificate.from_base64``) until ``certificate_expires_at`` (Unix seconds) with
    ``run_public_key`` (raw 32 bytes, for ``CertificateVerifier``) is what the swarm's
    handshakes check. ``bootstrap`` lists addresses of live peers to start the node with;
    ``checkpoint`` describes the run's newest checkpoint, or is None; progress reports go
    every ``report_interval_s``, as the coordinator asks."""

    run_id: str
    peer_id: str
    peer_token: str = field(repr=False)
    certificate: str = field(repr=False)
    certificate_expires_at: float
    run_public_key: bytes = field(repr=False)
    run_name: str
    status: str
    task: str
    config: Mapping[str, Any]  # the organizer's hyper-parameters: free-form JSON
    bootstrap: tuple[str, ...]
    checkpoint: CheckpointPublic | None
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S  # how often to report progress


@dataclass(frozen=True, slots=True)
class Reachability:
    """The coordinator's attempt to connect back to a peer at ``host`` (as it sees the
    peer): ``address`` is what it now announces for the peer (None when unreachable);
    ``detail`` is one line for the volunteer."""

    reachable: bool
    address: str | None
    host: str
    port: int
    bulk_port: int | None
    detail: str


# --------------------------------------------------------------------------- client


class CoordinatorClient:
    """The coordinator at ``url`` (``http://host:port`` or ``https://...``, with a path
    prefix if it sits behind one).

    ``timeout`` bounds each network operation (connect, each read and write), not a whole
    transfer. ``transport`` replaces the network (``httpx.MockTransport`` in tests). Use as a
    context manager or call :meth:`close`.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url, self.host = _parse_url(url)
        if not timeout > 0:
            raise ValueError("timeout must be > 0 seconds")
        self.timeout = float(timeout)
        self._http = httpx.Client(
            base_url=self.url,
            timeout=self.timeout,
            transport=transport,
            follow_redirects=False,
            headers={"User-Agent": "swarmgrad-peer"},
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CoordinatorClient({self.host!r})"

    # ------------------------------------------------------------------ volunteer

    def join_challenge(self, join_token: str) -> JoinChallenge:
        """The run ``join_token`` invites to, and a challenge for :meth:`join`. Raises
        :class:`Unauthorized` for an unknown, expired or revoked token and
        :class:`RunNotAccepting` once the run is finished or archived (a paused run admits
        peers: they wait until it resumes)."""
        body = self._parse(
            JoinChallengePublic,
            self._json("POST", f"{API_PREFIX}/join/challenge", token=join_token),
        )
        return JoinChallenge(
            run_id=body.run_id,
            run_name=body.run_name,
            task=body.task,
            status=body.status.value,
            challenge=body.challenge,
            expires_at=_timestamp(body.expires_at),
        )

    def join(
        self,
        join_token: str,
        challenge: JoinChallenge,
        identity: Identity,
        *,
        client_mode: bool = False,
        display_name: str | None = None,
    ) -> JoinAnswer:
        """Join ``challenge``'s run as ``identity``: signs the join proof with the identity's
        key. Joining again with the same key is allowed and uses up no invite. Raises
        :class:`Forbidden` when the coordinator refuses the proof (the challenge expired:
        ask for a new one), :class:`Unauthorized` for a used-up token."""
        payload = join_proof_payload(challenge.run_id, challenge.challenge, identity.public_key)
        request: dict[str, Any] = {
            "public_key": _b64(identity.public_key),
            "challenge": challenge.challenge,
            "signature": _b64(identity.sign(payload)),
            "client_mode": bool(client_mode),
        }
        if display_name is not None:
            request["display_name"] = display_name
        body = self._parse(
            JoinResponse,
            self._json(
                "POST", _run_path(challenge.run_id, "join"), token=join_token, json_body=request
            ),
        )
        run_public_key = _build(self.host, lambda: _unb64(body.run_public_key))
        return JoinAnswer(
            run_id=body.run_id,
            peer_id=body.peer_id,
            peer_token=body.peer_token,
            certificate=body.certificate,
            certificate_expires_at=_timestamp(body.certificate_expires_at),
            run_public_key=run_public_key,
            run_name=body.run_name,
            status=body.status.value,
            task=body.task,
            config=dict(body.config),
            bootstrap=_addresses(body.bootstrap),
            checkpoint=body.checkpoint,
            report_interval_s=body.report_interval_s,
        )

    def check_reachability(
        self, peer_token: str, run_id: str, port: int, bulk_port: int | None
    ) -> Reachability:
        """Ask the coordinator to connect back to this peer's ``port`` (and ``bulk_port``)
        at the address it sees the request come from; it then announces the peer there, or
        as a client-mode peer. :class:`RateLimited` when asked again too soon."""
        request = ReachabilityRequest(port=port, bulk_port=bulk_port)
        body = self._parse(
            ReachabilityPublic,
            self._json(
                "POST",
                _run_path(run_id, "reachability"),
                token=peer_token,
                json_body=request.model_dump(mode="json"),
            ),
        )
        return Reachability(
            reachable=body.reachable,
            address=body.address,
            host=body.host,
            port=body.port,
            bulk_port=body.bulk_port,
            detail=body.detail,
        )

    def bootstrap(self, peer_token: str, run_id: str) -> list[str]:
        """Addresses of a sample of live peers of the run (never this one's)."""
        body = self._parse(
            BootstrapPublic, self._json("GET", _run_path(run_id, "bootstrap"), token=peer_token)
        )
        return list(_addresses(body.peers))

    def renew_certificate(self, peer_token: str, run_id: str) -> tuple[str, float]:
        """A fresh run certificate: ``(certificate_base64, expires_at_unix_seconds)``.
        :class:`RunNotAccepting` once the run is finished or archived."""
        body = self._parse(
            CertificatePublic,
            self._json("POST", _run_path(run_id, "certificate"), token=peer_token),
        )
        return body.certificate, _timestamp(body.certificate_expires_at)

    def report(
        self,
        peer_token: str,
        run_id: str,
        fields: Mapping[str, Any],
        *,
        timeout: float | None = None,
    ) -> None:
        """Send one progress report (``epoch``, ``samples``, ``samples_per_second``, and
        optionally ``loss``, ``group_size``, ``rounds_done``, ``rounds_failed`` since the
        previous report, ``failure``, ``eval_metric``). Fields that are None are left out.
        ``ValueError`` for NaN or infinity; :class:`RunNotAccepting` once the run is
        finished (stop training)."""
        body = {k: v for k, v in fields.items() if v is not None}
        content = _json_bytes(body)
        self._request(
            "POST",
            _run_path(run_id, "reports"),
            token=peer_token,
            content=content,
            headers={"Content-Type": "application/json"},
            timeout=timeout,
        )

    def leave(self, peer_token: str, run_id: str, *, timeout: float | None = None) -> None:
        """Tell the coordinator this peer stops: it shows offline at once (until its next
        report or join) instead of after the presence window. Idempotent."""
        self._request("POST", _run_path(run_id, "leave"), token=peer_token, timeout=timeout)

    def run(self, run_id: str) -> RunPublic:
        """The run: its name, task, config, status, public key, ... (public, no token)."""
        return self._parse(RunPublic, self._json("GET", _run_path(run_id)))

    def revocations(self, run_id: str) -> bytes:
        """The run's revocation list as its authority signed it (public, no token; a node
        checks it: :meth:`peer.Node.revoke`). :class:`NotACoordinator` for an answer
        that does not carry one."""
        answer = self._json("GET", _run_path(run_id, "revocations"))
        try:
            text = RevocationsPublic.model_validate(answer).list
            return base64.urlsafe_b64decode(text.encode("ascii"))
        except ValueError:  # pydantic's ValidationError and binascii.Error are ones
            raise NotACoordinator("the answer carries no revocation list") from None

    def progress(self, run_id: str) -> ProgressPublic:
        """The run's progress as the dashboard shows it (public, no token)."""
        return self._parse(ProgressPublic, self._json("GET", _run_path(run_id, "progress")))

    def upload_checkpoint(
        self, peer_token: str, run_id: str, epoch: int, data: bytes
    ) -> CheckpointPublic | CheckpointHeld:
        """Upload a checkpoint (the bytes ``torch.save`` wrote) of swarm epoch ``epoch``;
        returns its description, or a :class:`CheckpointHeld` when the coordinator kept only
        its digest (and says why). :class:`RunNotAccepting` when the run already has one of
        that epoch or newer; :class:`RequestRejected` when it is too large or not a
        torch.save file."""
        body = self._json(
            "PUT",
            _run_path(run_id, "checkpoint"),
            token=peer_token,
            params={"epoch": int(epoch)},
            content=bytes(data),
            headers={"Content-Type": "application/octet-stream"},
        )
        try:
            return CheckpointPublic.model_validate(body)
        except ValidationError:  # 202: the coordinator kept only the digest, and says why
            return self._parse(CheckpointHeld, body)

    def download_checkpoint(self, token: str, run_id: str) -> tuple[bytes, int] | None:
        """The run's newest checkpoint as ``(data, epoch)``, or None when it has none
        (``token``: the peer's token or an organizer's). The data are checked against the
        SHA-256 the coordinator names."""
        try:
            response = self._request("GET", _run_path(run_id, "checkpoint"), token=token)
        except NotFound:
            return None
        data = response.content
        epoch_text = response.headers.get("X-Checkpoint-Epoch", "")
        if not epoch_text.isdigit():
            raise CoordinatorFailed(
                f"the coordinator at {self.host} sent a checkpoint without its epoch",
                status_code=response.status_code,
            )
        expected = response.headers.get("X-Checkpoint-SHA256")
        if expected is not None and hashlib.sha256(data).hexdigest() != expected.lower():
            raise CoordinatorFailed(
                f"the checkpoint from {self.host} arrived damaged (SHA-256 mismatch); try again",
                status_code=response.status_code,
            )
        return data, int(epoch_text)

    # ------------------------------------------------------------------ organizer

    def create_run(
        self, token: str, name: str, task: str, config: Mapping[str, Any] | None = None
    ) -> RunPublic:
        """Create a run (status "running") with ``config``, the hyper-parameters its peers
        read (free-form JSON); returns it."""
        body = self._json(
            "POST",
            f"{API_PREFIX}/runs",
            token=token,
            json_body={"name": name, "task": task, "config": dict(config or {})},
        )
        return self._parse(RunPublic, body)

    def list_runs(self, *, include_archived: bool = False) -> list[RunPublic]:
        """Runs, newest first (public)."""
        params = {"include_archived": "true"} if include_archived else None
        return self._parse(RunsPublic, self._json("GET", f"{API_PREFIX}/runs", params=params)).runs

    def update_run(
        self,
        token: str,
        run_id: str,
        *,
        name: str | None = None,
        status: RunStatus | str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> RunPublic:
        """Change the run's ``name``, ``status`` ("running", "paused", "finished") or
        ``config``; what is None stays as it is. Returns the run as changed."""
        fields = {
            k: v
            for k, v in {
                "name": name,
                "status": None if status is None else RunStatus(status).value,
                "config": None if config is None else dict(config),
            }.items()
            if v is not None
        }
        body = self._json("PATCH", _run_path(run_id), token=token, json_body=fields)
        return self._parse(RunPublic, body)

    def create_invite(
        self,
        token: str,
        run_id: str,
        *,
        max_uses: int | None = None,
        expires_in_s: float | None = None,
        label: str | None = None,
    ) -> TokenCreated:
        """A join token for volunteers, with its limits. The token is shown only in this
        answer."""
        request = {
            k: v
            for k, v in {
                "max_uses": max_uses,
                "expires_in_s": expires_in_s,
                "label": label,
            }.items()
            if v is not None
        }
        body = self._json("POST", _run_path(run_id, "tokens"), token=token, json_body=request)
        return self._parse(TokenCreated, body)

    def list_organizer_tokens(self, token: str) -> list[OrganizerTokenPublic]:
        """The coordinator's organizer tokens, oldest first, without secrets (``current``
        marks the caller's)."""
        return self._parse(
            OrganizerTokensPublic, self._json("GET", f"{API_PREFIX}/tokens", token=token)
        ).tokens

    def create_organizer_token(
        self, token: str, *, label: str | None = None, expires_in_s: float | None = None
    ) -> OrganizerTokenCreated:
        """A new organizer token, shown only in this answer."""
        request = {"label": label, "expires_in_s": expires_in_s}
        body = {k: v for k, v in request.items() if v is not None}
        answer = self._json("POST", f"{API_PREFIX}/tokens", token=token, json_body=body)
        return self._parse(OrganizerTokenCreated, answer)

    def revoke_organizer_token(self, token: str, token_id: str) -> None:
        """Revoke an organizer token. :class:`RequestRejected` (409) for the caller's own
        token while it is the coordinator's last one."""
        self._request("DELETE", f"{API_PREFIX}/tokens/{quote(token_id, safe='')}", token=token)

    def list_checkpoints(self, token: str, run_id: str) -> list[CheckpointPublic]:
        """The checkpoints the coordinator keeps for the run, newest first."""
        return self._parse(
            CheckpointsPublic, self._json("GET", _run_path(run_id, "checkpoints"), token=token)
        ).checkpoints

    def pin_checkpoint(self, token: str, run_id: str, epoch: int) -> CheckpointPublic:
        """Serve the checkpoint of ``epoch`` (downloads, joining peers) instead of the newest,
        until unpinned; returns it. :class:`NotFound` when the run has none of that epoch."""
        return self._parse(
            CheckpointPublic,
            self._json("POST", _run_path(run_id, f"checkpoints/{int(epoch)}/pin"), token=token),
        )

    def unpin_checkpoint(self, token: str, run_id: str) -> None:
        """Serve the run's newest checkpoint again."""
        self._request("DELETE", _run_path(run_id, "checkpoints/pin"), token=token)

    def delete_checkpoint(self, token: str, run_id: str, epoch: int) -> None:
        """Remove the checkpoint of ``epoch``; :class:`NotFound` when there is none."""
        self._request("DELETE", _run_path(run_id, f"checkpoints/{int(epoch)}"), token=token)

    # ------------------------------------------------------------------ plumbing

    def _parse(self, model: type[_M], body: dict[str, Any]) -> _M:
        """``body`` as the payload type both sides share (:mod:`peer.formats.payloads`); an
        answer of another shape is not a coordinator of this version, said with its field."""
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "body"
            what = f"no {where!r}" if first["type"] == "missing" else f"a malformed {where!r}"
            raise NotACoordinator(
                f"{self.host} sent an answer with {what}; it is not a Swarmgrad coordinator "
                "of this version"
            ) from exc

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._request(method, path, **kwargs)
        try:
            body = response.json()
        except ValueError as exc:
            raise NotACoordinator(
                f"{self.host} answered but is not a Swarmgrad coordinator (the answer is not JSON)",
                status_code=response.status_code,
            ) from exc
        if not isinstance(body, dict):
            raise NotACoordinator(
                f"{self.host} answered but is not a Swarmgrad coordinator "
                "(the answer is not a JSON object)",
                status_code=response.status_code,
            )
        return body

    def _request(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        json_body: Any = None,
        content: bytes | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        all_headers = dict(headers or {})
        if token is not None:
            all_headers["Authorization"] = f"Bearer {check_token(token)}"
        if json_body is not None:
            content = _json_bytes(json_body)
            all_headers["Content-Type"] = "application/json"
        try:
            response = self._http.request(
                method,
                path,
                content=content,
                params=params,
                headers=all_headers,
                timeout=self.timeout if timeout is None else timeout,
            )
        except httpx.TimeoutException as exc:
            limit = self.timeout if timeout is None else timeout
            raise CoordinatorUnreachable(
                f"the coordinator at {self.host} did not answer within {limit:g} s"
            ) from exc
        except httpx.ConnectError as exc:
            raise CoordinatorUnreachable(
                f"cannot reach the coordinator at {self.host}: {reason(exc)}"
            ) from exc
        except httpx.TransportError as exc:
            raise CoordinatorUnreachable(
                f"lost the connection to the coordinator at {self.host}: {reason(exc)}"
            ) from exc
        if response.headers.get(COORDINATOR_HEADER) != "1":
            self._not_a_coordinator(response)
        if response.status_code >= 400:
            raise error_from(response)
        if response.status_code >= 300:
            raise CoordinatorFailed(
                f"the coordinator at {self.host} answered HTTP {response.status_code} "
                "where it never redirects",
                status_code=response.status_code,
            )
        return response

    def _not_a_coordinator(self, response: httpx.Response) -> NoReturn:
        code = response.status_code
        if code in _GATEWAY_DOWN:
            # A reverse proxy in front of a coordinator that is down or restarting.
            raise CoordinatorUnreachable(
                f"{self.host} answered {code} {response.reason_phrase}: "
                "the coordinator behind it is not answering",
                status_code=code,
            )
        raise NotACoordinator(
            f"{self.host} answered but is not a Swarmgrad coordinator (HTTP {code}); check the URL",
            status_code=code,
        )


# --------------------------------------------------------------------------- helpers


def _parse_url(url: str) -> tuple[str, str]:
    """The base URL without credentials, query or fragment, and ``host[:port]`` to name in
    messages."""
    if not isinstance(url, str):
        raise TypeError("the coordinator URL is a string, e.g. 'http://127.0.0.1:8000'")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            "the coordinator URL must start with http:// or https:// (e.g. http://host:8000)"
        )
    try:
        hostname, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ValueError("the coordinator URL has an invalid port") from exc
    if not hostname:
        raise ValueError("the coordinator URL names no host (e.g. http://host:8000)")
    host = f"[{hostname}]" if ":" in hostname else hostname
    shown = host if port is None else f"{host}:{port}"
    base = urlunsplit((parts.scheme, shown, parts.path.rstrip("/"), "", ""))
    return base, shown


def check_token(token: str) -> str:
    """``token`` without surrounding blanks; ``ValueError`` (never echoing it) if it
    cannot be a token."""
    if not isinstance(token, str) or not token.strip():
        raise ValueError("a token is needed (the text after --token)")
    token = token.strip()
    if not _TOKEN_CHARS.match(token):
        raise ValueError("the token holds characters no token has; copy it again")
    return token


def _run_path(run_id: str, *rest: str) -> str:
    if not isinstance(run_id, str) or not run_id:
        raise ValueError("run_id must be a non-empty string")
    return "/".join((f"{API_PREFIX}/runs", quote(run_id, safe=""), *rest))


def _json_bytes(value: Any) -> bytes:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
    except ValueError as exc:
        raise ValueError("a coordinator request cannot carry NaN or infinity") from exc


def _build(host: str, build: Any) -> Any:
    """``build()``, with an answer that lacks a field or has one of the wrong type reported
    as what it is: not the coordinator this client speaks to."""
    try:
        return build()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        what = f"no {exc.args[0]!r}" if isinstance(exc, KeyError) else "a malformed field"
        raise NotACoordinator(
            f"{host} sent an answer with {what}; it is not a Swarmgrad coordinator of this version"
        ) from exc


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a string")
    return value


def _timestamp(moment: datetime) -> float:
    """Unix seconds of a time (UTC when it names no zone)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _addresses(peers: Iterable[BootstrapPeer]) -> tuple[str, ...]:
    """The peers' addresses in order, without repeats."""
    return tuple(dict.fromkeys(address for peer in peers for address in peer.addresses))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def _unb64(value: Any) -> bytes:
    text = _str(value)
    try:
        return base64.urlsafe_b64decode(text.rstrip("=").encode("ascii") + b"==")
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError("not urlsafe base64") from exc
