"""Who may stay in the swarm: certificates and bans, a part of :class:`peer.node.core.AsyncNode`.

In certificate mode a node keeps a book of the run's certificates (its own included), takes
renewed ones over open links (``link.credential``), closes a link whose peer's certificate
expired without a renewal and drops the records of owners whose certificates expired. With
the run's key at hand it also applies the run's revocation list (``link.revocations``): a
banned peer's links close, its records go, it cannot link again, and the list is passed on
to every other linked peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Coroutine, Iterable

from peer.exceptions import AuthenticationError, ProtocolError, SwarmgradError
from peer.formats.identity import Authenticator, Certificate, CertificateAuth, Identity
from peer.formats.revocation import MAX_LIST_BYTES, RevocationBook
from peer.node.certificates import CertificateBook
from peer.node.gossip import (
    GossipStore,
)
from peer.node.links import Handler, PeerLink, RemotePeer
from peer.wire import Frame, Scalar, Schema

logger = logging.getLogger("peer.node")

__all__ = ["LINK_CREDENTIAL", "LINK_REVOCATIONS", "Trust", "clock_skew", "send_quietly"]

LINK_CREDENTIAL = "link.credential"  # a renewed certificate, presented over an open link
LINK_REVOCATIONS = "link.revocations"  # the run's revocation list, passed from peer to peer


def clock_skew(auth: CertificateAuth) -> float:
    """The clock-skew grace of the node's certificate verifier (5 s unless it says)."""
    skew = getattr(auth.verify, "max_clock_skew", 5.0)
    return float(skew) if isinstance(skew, int | float) else 5.0


async def send_quietly(link: PeerLink, frame: Frame) -> None:
    """Send ``frame`` if the link still can; a link that closed meanwhile is no error."""
    with contextlib.suppress(SwarmgradError):
        await link.send(frame)


class Trust:
    """A node's certificates and bans. The node owns one and hands it what it needs:
    ``now`` (its clock), ``spawn(coroutine, name)`` (a task the node stops at shutdown),
    ``links()`` (its open links), ``running()`` (started and not stopping) and
    ``register(message_type, schema, handler)`` (accept a message type from peers)."""

    def __init__(
        self,
        *,
        auth: Authenticator,
        identity: Identity,
        store: GossipStore,
        now: Callable[[], float],
        spawn: Callable[[Coroutine[object, object, object], str], object],
        links: Callable[[], Iterable[PeerLink]],
        running: Callable[[], bool],
        register: Callable[[str, Schema, Handler], None],
    ) -> None:
        self.auth = auth
        self.identity = identity
        self.store_ = store
        self.now = now
        self._spawn = spawn
        self._links = links
        self._running = running
        # certificate mode: which record owners hold a valid certificate of the run
        self.certificates: CertificateBook | None = None
        # certificate mode with the run's key at hand: the peers the run's authority banned
        self.revocations: RevocationBook | None = None
        if isinstance(auth, CertificateAuth):
            self.certificates = CertificateBook(auth.verify, max_clock_skew=clock_skew(auth))
            run_key = getattr(auth.verify, "run_public_key", None)
            run_id = getattr(auth.verify, "run_id", None)
            if isinstance(run_key, bytes) and isinstance(run_id, str):
                self.revocations = RevocationBook(run_key, run_id)
        self._banned_self_warned = False
        # accept renewed certificates and revocation lists over links
        register(
            LINK_CREDENTIAL,
            Schema(required={"credential": Scalar(bytes, max_length=4096)}),
            self._on_credential,
        )
        register(
            LINK_REVOCATIONS,
            Schema(required={"list": Scalar(bytes, max_length=MAX_LIST_BYTES)}),
            self._on_revocations,
        )

    def set_auth(self, auth: Authenticator) -> None:
        """Present ``auth`` in every later handshake (a renewed run certificate, say); open
        links stay as they are. The mode cannot change (``ValueError``): every peer of a
        swarm uses the same one."""
        if auth.mode != self.auth.mode:
            raise ValueError(
                f"this node authenticates with {self.auth.mode!r}; it cannot switch to "
                f"{auth.mode!r} (every peer of a swarm uses the same mode)"
            )
        self.auth = auth
        self.learn_own_certificate()
        if isinstance(auth, CertificateAuth) and self._running():
            # open links would close at the old certificate's expiry: show them the new one
            frame = Frame(LINK_CREDENTIAL, {"credential": auth.certificate})
            for link in list(self._links()):
                if not link.closed:
                    self._spawn(send_quietly(link, frame), "credential")

    async def _on_credential(self, link: PeerLink, frame: Frame) -> None:
        """A peer renewed its certificate: check it like a handshake's, keep the link."""
        if not isinstance(self.auth, CertificateAuth):
            return None
        try:
            verified = self.auth.verify(frame.fields["credential"], link.remote.public_key)
        except Exception as exc:  # a verifier is user code: any failure refuses
            logger.warning(
                "closing the link to %s: its renewed certificate is refused: %s", link.peer_id, exc
            )
            await link.close(f"renewed certificate refused: {exc}")
            return None
        link.remote = dataclasses.replace(
            link.remote, credential=verified, certificate=frame.fields["credential"]
        )
        self.learn_certificate(link.remote)
        return None

    def learn_certificate(self, remote: RemotePeer) -> None:
        if self.banned(remote.public_key):
            return
        if self.certificates is not None and remote.certificate:
            self.certificates.learn(
                remote.public_key, remote.certificate, remote.credential, self.now()
            )

    def learn_own_certificate(self) -> None:
        """This node's records travel with its own certificate: keep it in the book."""
        if self.certificates is None or not isinstance(self.auth, CertificateAuth):
            return
        self.certificates.verify = self.auth.verify  # set_auth may bring a new verifier
        try:
            verified = self.auth.verify(self.auth.certificate, self.identity.public_key)
        except Exception as exc:  # a verifier is user code: any failure refuses
            logger.warning("this node's own certificate is refused: %s", exc)
            return
        self.certificates.learn(
            self.identity.public_key, self.auth.certificate, verified, self.now()
        )

    def close_expired_links(self) -> None:
        """Links stay authenticated only while the peer's certificate is valid (with the
        verifier's clock-skew tolerance): one that expired without a renewal is closed."""
        if not isinstance(self.auth, CertificateAuth):
            return
        skew = clock_skew(self.auth)
        now = self.now()
        for link in list(self._links()):
            expires = getattr(link.remote.credential, "expires_at", None)
            if isinstance(expires, int | float) and expires + skew < now and not link.closed:
                logger.warning(
                    "closing the link to %s: its certificate expired and was not renewed",
                    link.peer_id,
                )
                self._spawn(link.close("certificate expired"), "expired")

    def forget_expired_certificates(self, now: float) -> None:
        """Only holders of a valid certificate own records: an owner whose certificate
        expired without a renewal reaching this node loses its records here."""
        if self.certificates is None:
            return
        owners = [o for o in self.certificates.expire(now) if o != self.identity.public_key]
        gone = self.store_.drop_owners(owners)
        if gone:
            logger.info(
                "dropped %d record(s) of %d peer(s) whose certificates expired",
                len(gone),
                len(owners),
            )

    def certified_role(self, peer_id: str) -> str | None:
        """The role the run's authority gave ``peer_id`` in its certificate (certificate
        mode, once this node has seen that certificate); None otherwise."""
        return self.certificates.role(peer_id) if self.certificates is not None else None

    def certified_volunteer(self, peer_id: str) -> str | None:
        """The volunteer (person) ``peer_id``'s certificate names (certificate mode, once
        this node has seen that certificate, or this node's own); None otherwise. Several
        keys of one person name the same volunteer."""
        if self.certificates is None:
            return None
        own = self._own_certificate(peer_id)
        return own.volunteer if own is not None else self.certificates.volunteer(peer_id)

    def certified_invite(self, peer_id: str) -> str | None:
        """The invite that admitted ``peer_id``'s volunteer, as its certificate names it
        (certificate mode, once this node has seen that certificate, or this node's own);
        None otherwise."""
        if self.certificates is None:
            return None
        own = self._own_certificate(peer_id)
        return own.invite if own is not None else self.certificates.invite(peer_id)

    def _own_certificate(self, peer_id: str) -> Certificate | None:
        if peer_id != self.identity.peer_id or not isinstance(self.auth, CertificateAuth):
            return None
        try:
            return Certificate.from_bytes(self.auth.certificate)
        except (ValueError, TypeError):
            return None

    def banned(self, public_key: bytes) -> bool:
        book = self.revocations
        return (
            book is not None
            and book.current is not None
            and public_key != self.identity.public_key
            and book.revoked(public_key, self.now())
        )

    def revoke(self, data: bytes) -> bool:
        """Apply the run's revocation list ``data`` (its bytes, as the coordinator serves
        them): every link to a banned peer closes, its records go and it cannot link again;
        the list is passed on to every other linked peer. Returns whether it was news (an
        older or known list changes nothing). :class:`AuthenticationError` for a list the
        run's authority did not sign; ``ValueError`` when this node cannot check one (it
        is not in certificate mode with a :class:`~peer.formats.identity.CertificateVerifier`)."""
        if self.revocations is None:
            raise ValueError(
                "this node cannot check a revocation list: it is not in certificate mode "
                "with a CertificateVerifier that names the run's key"
            )
        if self.revocations.offer(data) is None:
            return False
        self._enforce_bans(bytes(data), came_from=None)
        return True

    async def _on_revocations(self, link: PeerLink, frame: Frame) -> None:
        if self.revocations is None:
            return None
        data = frame.fields["list"]
        try:
            news = self.revocations.offer(data)
        except AuthenticationError as exc:
            # only a forger or a broken peer sends a list the authority did not sign
            raise ProtocolError(f"a forged revocation list: {exc}") from None
        if news is not None:
            self._enforce_bans(data, came_from=link.peer_id)
        return None

    def _enforce_bans(self, data: bytes, came_from: str | None) -> None:
        book = self.revocations
        assert book is not None and book.current is not None
        now = self.now()
        banned = set(book.revoked_keys(now))
        if self.identity.public_key in banned and not self._banned_self_warned:
            self._banned_self_warned = True
            logger.error("this peer is banned from the run by its authority")
        banned.discard(self.identity.public_key)
        logger.info(
            "revocation list %d of the run (%d banned peer(s)) from %s",
            book.current.serial,
            len(banned),
            came_from or "the coordinator",
        )
        frame = Frame(LINK_REVOCATIONS, {"list": data})
        for link in list(self._links()):
            if link.closed:
                continue
            if link.remote.public_key in banned:
                logger.warning(
                    "closing the link to %s: the run's authority banned it", link.peer_id
                )
                self._spawn(link.close("banned by the run's authority"), "banned")
            elif link.peer_id != came_from:
                self._spawn(send_quietly(link, frame), "revocations")
        if self.certificates is not None:
            self.certificates.forget(banned)
        gone = self.store_.drop_owners(list(banned))
        if gone:
            logger.info("dropped %d record(s) of banned peers", len(gone))
