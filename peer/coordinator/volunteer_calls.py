"""The volunteer's calls of the coordinator's REST API, in the order a peer makes them, and the
answers it keeps: :class:`JoinChallenge`, :class:`JoinAnswer`, :class:`Reachability`.

:meth:`~VolunteerCalls.join_challenge` (names the run and its task), :meth:`~VolunteerCalls.join`
(proves the peer holds its key; returns a peer token and a run certificate),
:meth:`~VolunteerCalls.check_reachability`, then, while training, :meth:`~VolunteerCalls.report`,
:meth:`~VolunteerCalls.renew_certificate`, :meth:`~VolunteerCalls.bootstrap` and the checkpoint
calls — usually through a :class:`~peer.coordinator.session.CoordinatorSession`. Each sends
its request of :mod:`peer.formats.requests` and parses the answer into its type of
:mod:`peer.formats.payloads` before a field is read.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import ValidationError

from peer.coordinator.connection import API_PREFIX, CoordinatorConnection, run_path
from peer.coordinator.exceptions import CoordinatorFailed, NotACoordinator, NotFound
from peer.formats.identity import Identity, join_proof_payload
from peer.formats.open_types import ConfigValues
from peer.formats.payloads import (
    DEFAULT_REPORT_INTERVAL_S,
    BootstrapPeer,
    BootstrapPublic,
    CertificatePublic,
    CheckpointHeld,
    CheckpointPublic,
    JoinChallengePublic,
    JoinResponse,
    ReachabilityPublic,
    RendezvousPeer,
    RendezvousPublic,
    RevocationsPublic,
    RunPublic,
)
from peer.formats.requests import JoinRequest, ReachabilityRequest, ReportCreate

__all__ = ["JoinAnswer", "JoinChallenge", "Reachability", "VolunteerCalls"]

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
    config: ConfigValues  # the organizer's hyper-parameters: free-form JSON
    bootstrap: tuple[str, ...]
    checkpoint: CheckpointPublic | None
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S  # how often to report progress
    relays: tuple[str, ...] = ()  # to register with when no other peer can dial this one


# The coordinator's answer to a reachability check (its attempt to connect back to the
# peer), under the name this client has always exported.
Reachability = ReachabilityPublic


# --------------------------------------------------------------------------- client


class VolunteerCalls(CoordinatorConnection):
    """The calls a volunteer's peer makes (``peer_token``: the one :meth:`join` returns),
    and the public reads it needs."""

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
        # built as given (the coordinator checks it); display_name only when there is one
        request = JoinRequest.model_construct(
            {"public_key", "challenge", "signature", "client_mode"}
            | ({"display_name"} if display_name is not None else set()),
            public_key=_b64(identity.public_key),
            challenge=challenge.challenge,
            signature=_b64(identity.sign(payload)),
            client_mode=bool(client_mode),
            display_name=display_name,
        )
        body = self._parse(
            JoinResponse,
            self._json("POST", run_path(challenge.run_id, "join"), token=join_token, body=request),
        )
        run_public_key = _run_key(self.host, body.run_public_key)
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
            relays=tuple(body.relays),
        )

    def check_reachability(
        self,
        peer_token: str,
        run_id: str,
        port: int,
        bulk_port: int | None,
        *,
        punch_port: int | None = None,
    ) -> Reachability:
        """Ask the coordinator to connect back to this peer's ``port`` (and ``bulk_port``)
        at the address it sees the request come from; it then announces the peer there, or,
        given the ``punch_port`` this peer punches through its NAT from, at a ``punch://``
        address (``punch_address``) that other punching peers are introduced to, or as a
        client-mode peer. :class:`RateLimited` when asked again too soon."""
        # punch_port only when there is one: the body a peer that does not punch sends is
        # the one every coordinator knows
        fields = {"port": port, "bulk_port": bulk_port}
        if punch_port is not None:
            fields["punch_port"] = punch_port
        request = ReachabilityRequest.model_validate(fields)  # ValueError before sending
        return self._parse(
            ReachabilityPublic,
            self._json("POST", run_path(run_id, "reachability"), token=peer_token, body=request),
        )

    def rendezvous(self, peer_token: str, run_id: str) -> list[RendezvousPeer]:
        """The run's peers behind NATs that punch (never this one): each one's public
        address as the coordinator saw it and the port it punches from."""
        body = self._parse(
            RendezvousPublic, self._json("GET", run_path(run_id, "rendezvous"), token=peer_token)
        )
        return list(body.peers)

    def bootstrap(self, peer_token: str, run_id: str) -> list[str]:
        """Addresses of a sample of live peers of the run (never this one's)."""
        body = self._parse(
            BootstrapPublic, self._json("GET", run_path(run_id, "bootstrap"), token=peer_token)
        )
        return list(_addresses(body.peers))

    def renew_certificate(self, peer_token: str, run_id: str) -> tuple[str, float]:
        """A fresh run certificate: ``(certificate_base64, expires_at_unix_seconds)``.
        :class:`RunNotAccepting` once the run is finished or archived."""
        body = self._parse(
            CertificatePublic,
            self._json("POST", run_path(run_id, "certificate"), token=peer_token),
        )
        return body.certificate, _timestamp(body.certificate_expires_at)

    def report(
        self,
        peer_token: str,
        run_id: str,
        report: ReportCreate,
        *,
        timeout: float | None = None,
    ) -> None:
        """Send one progress report (build it from training's numbers with
        :func:`peer.coordinator.reports.clean_report`). Fields it leaves unset or None are
        not sent. :class:`RunNotAccepting` once the run is finished (stop training)."""
        content = report.model_dump_json(exclude_unset=True, exclude_none=True).encode()
        self._request(
            "POST",
            run_path(run_id, "reports"),
            token=peer_token,
            content=content,
            headers={"Content-Type": "application/json"},
            timeout=timeout,
        )

    def leave(self, peer_token: str, run_id: str, *, timeout: float | None = None) -> None:
        """Tell the coordinator this peer stops: it shows offline at once (until its next
        report or join) instead of after the presence window. Idempotent."""
        self._request("POST", run_path(run_id, "leave"), token=peer_token, timeout=timeout)

    def run(self, run_id: str) -> RunPublic:
        """The run: its name, task, config, status, public key, ... (public, no token)."""
        return self._parse(RunPublic, self._json("GET", run_path(run_id)))

    def revocations(self, run_id: str) -> bytes:
        """The run's revocation list as its authority signed it (public, no token; a node
        checks it: :meth:`peer.Node.revoke`). :class:`NotACoordinator` for an answer
        that does not carry one."""
        answer = self._json("GET", run_path(run_id, "revocations"))
        try:
            text = RevocationsPublic.model_validate(answer).list
            return base64.urlsafe_b64decode(text.encode("ascii"))
        except ValueError:  # pydantic's ValidationError and binascii.Error are ones
            raise NotACoordinator("the answer carries no revocation list") from None

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
            run_path(run_id, "checkpoint"),
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
            response = self._request("GET", run_path(run_id, "checkpoint"), token=token)
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

    def download_task(self, token: str, run_id: str) -> bytes:
        """The task file the run ships (``token``: an invite of the run, a peer's token or
        an organizer's); the caller checks it against the run's ``task_file.sha256``."""
        return self._request("GET", run_path(run_id, "task"), token=token).content


# --------------------------------------------------------------------------- helpers


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


def _run_key(host: str, text: str) -> bytes:
    """The run's public key the join answer carries (urlsafe base64): an answer whose key
    does not decode is not from the coordinator this client speaks to."""
    try:
        return base64.urlsafe_b64decode(text.rstrip("=").encode("ascii") + b"==")
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise NotACoordinator(
            f"{host} sent an answer with a malformed 'run_public_key'; it is not a Swarmgrad "
            "coordinator of this version"
        ) from exc
