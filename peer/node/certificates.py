"""Certificate mode's side of gossip, without I/O: which record owners hold a valid
certificate of the run (:class:`CertificateBook`), which records may therefore be sent, the
certificates that travel beside them, and a gossip frame's share of records within its byte
budget."""

from __future__ import annotations

import random
from dataclasses import dataclass

from peer.formats.identity import (
    PUBLIC_KEY_SIZE,
    CertificateVerify,
    peer_id_from_public_key,
)
from peer.node.gossip import MEMBERS_KEY, Record, RecordError


@dataclass(frozen=True, slots=True)
class OwnerCertificate:
    """A record owner's run certificate, as checked by this node's verifier."""

    certificate: bytes
    expires_at: float | None  # None: the verifier did not say; valid until replaced
    role: str | None = None  # the role the authority gave it, when the verifier says
    volunteer: str | None = None  # the person the key belongs to, when the certificate says
    invite: str | None = None  # the invite that admitted that person, when it says


class CertificateBook:
    """Which record owners hold a valid certificate of this run (certificate mode), no I/O.

    A node learns certificates from its handshakes and from renewals over its links
    (:meth:`learn`: already verified) and from those that travel beside the records of a
    gossip frame (:meth:`offer`: checked here with ``verify``, the node's own verifier).
    A sender attaches, for each owner of the records it sends, the certificate it holds,
    and sends only records whose owner's certificate is good for ``send_margin`` more
    seconds (:meth:`certificate_for`); a receiver accepts while ``expires_at +
    max_clock_skew`` is ahead of its clock (:meth:`valid`). So an honest relay never sends
    a record the receiver must refuse unless their clocks differ by more than the two
    together, and a record the receiver cannot vouch for marks its relay as hostile.

    Entries exist only for certificates the run's authority signed, so the book grows
    with the run's membership, not with what strangers send; past ``max_owners`` (with
    expired entries gone) new owners are not learnt and their records are refused."""

    def __init__(
        self,
        verify: CertificateVerify,
        *,
        max_clock_skew: float = 5.0,
        send_margin: float = 1.0,
        max_owners: int = 100_000,
    ) -> None:
        self.verify = verify
        self.max_clock_skew = max_clock_skew
        self.send_margin = send_margin
        self.max_owners = max_owners
        self._owners: dict[bytes, OwnerCertificate] = {}
        self._keys: dict[str, bytes] = {}  # peer id → owner key, for :meth:`role`

    def __len__(self) -> int:
        return len(self._owners)

    def role(self, peer_id: str) -> str | None:
        """The role in ``peer_id``'s certificate (e.g. ``"peer"``, ``"client"``), or None
        when this node holds no certificate of that peer or the verifier gives no role."""
        held = self._owners.get(self._keys.get(peer_id, b""))
        return held.role if held is not None else None

    def volunteer(self, peer_id: str) -> str | None:
        """The volunteer (person) ``peer_id``'s certificate names, or None when this node
        holds no certificate of that peer or it names none."""
        held = self._owners.get(self._keys.get(peer_id, b""))
        return held.volunteer if held is not None else None

    def invite(self, peer_id: str) -> str | None:
        """The invite ``peer_id``'s certificate names, or None when this node holds no
        certificate of that peer or it names none."""
        held = self._owners.get(self._keys.get(peer_id, b""))
        return held.invite if held is not None else None

    def __contains__(self, owner: bytes) -> bool:
        return owner in self._owners

    def learn(self, owner: bytes, certificate: bytes, verified: object, now: float) -> bool:
        """Remember ``owner``'s ``certificate``, which ``verify`` returned ``verified``
        for. A certificate expiring before the one held is ignored. Returns whether the
        owner is known now."""
        expires = getattr(verified, "expires_at", None)
        expires_at = (
            float(expires)
            if isinstance(expires, int | float) and not isinstance(expires, bool)
            else None
        )
        held = self._owners.get(owner)
        if held is None and len(self._owners) >= self.max_owners:
            self.expire(now)
            if len(self._owners) >= self.max_owners:
                return False
        if (
            held is not None
            and held.expires_at is not None
            and expires_at is not None
            and held.expires_at > expires_at
        ):
            return True
        role = getattr(verified, "role", None)
        volunteer = getattr(verified, "volunteer", None)
        invite = getattr(verified, "invite", None)
        self._owners[owner] = OwnerCertificate(
            bytes(certificate),
            expires_at,
            role if isinstance(role, str) else None,
            volunteer if isinstance(volunteer, str) else None,
            invite if isinstance(invite, str) else None,
        )
        self._keys[peer_id_from_public_key(owner)] = owner
        return True

    def offer(self, owner: bytes, certificate: bytes, now: float) -> None:
        """A certificate a peer sent for ``owner``: check it unless it is the one held.
        Raises :class:`RecordError` if the verifier refuses it."""
        held = self._owners.get(owner)
        if held is not None and held.certificate == certificate:
            return
        if len(owner) != PUBLIC_KEY_SIZE:
            raise RecordError("a certificate's owner is a 32-byte public key")
        try:
            verified = self.verify(certificate, owner)
        except Exception as exc:  # a verifier is user code: any failure refuses
            raise RecordError(
                f"the certificate sent for peer {peer_id_from_public_key(owner)} is refused: {exc}"
            ) from None
        self.learn(owner, certificate, verified, now)

    def valid(self, owner: bytes, now: float) -> bool:
        """Whether ``owner`` may own records now (with the verifier's clock-skew grace)."""
        held = self._owners.get(owner)
        return held is not None and (
            held.expires_at is None or held.expires_at + self.max_clock_skew >= now
        )

    def certificate_for(self, owner: bytes, now: float) -> bytes | None:
        """The certificate to send beside ``owner``'s records, or None when its records
        should not be sent at all (unknown, or expiring within ``send_margin``)."""
        held = self._owners.get(owner)
        if held is None or (
            held.expires_at is not None and held.expires_at <= now + self.send_margin
        ):
            return None
        return held.certificate

    def forget(self, owners: set[bytes] | list[bytes]) -> None:
        """Forget ``owners`` (banned peers): their records are refused from now on."""
        for owner in owners:
            self._owners.pop(owner, None)

    def expire(self, now: float) -> list[bytes]:
        """Forget and return the owners whose certificates are no longer valid."""
        gone = [owner for owner in self._owners if not self.valid(owner, now)]
        for owner in gone:
            del self._owners[owner]
            self._keys.pop(peer_id_from_public_key(owner), None)
        return gone


def sendable(records: list[Record], book: CertificateBook | None, now: float) -> list[Record]:
    """The records that may be sent (certificate mode: those whose owner's certificate
    this node can send beside them)."""
    if book is None:
        return records
    return [r for r in records if book.certificate_for(r.owner, now) is not None]


def certificates_for(
    records: list[Record], book: CertificateBook | None, now: float
) -> list[list[bytes]]:
    """The ``[owner, certificate]`` pairs to send beside ``records`` (certificate mode;
    with no book, none)."""
    if book is None:
        return []
    out: dict[bytes, bytes] = {}
    for record in records:
        if record.owner not in out:
            cert = book.certificate_for(record.owner, now)
            if cert is not None:
                out[record.owner] = cert
    return [[owner, cert] for owner, cert in out.items()]


def take_within_budget(
    records: list[Record],
    max_bytes: int,
    rng: random.Random,
    book: CertificateBook | None = None,
    now: float = 0.0,
) -> list[Record]:
    """A random subset of ``records`` whose encoded size stays under ``max_bytes``; the rest
    go in a later round. Membership records go first: they are how the swarm finds itself.
    With a certificate ``book``, only records that may be sent (:func:`sendable`), and each
    owner's certificate counts once against the budget."""
    rng.shuffle(records)
    records.sort(key=lambda r: r.key != MEMBERS_KEY)
    out: list[Record] = []
    size = 0
    owners: set[bytes] = set()
    for record in records:
        cost = len(record.value) + len(record.key) + 128
        if book is not None and record.owner not in owners:
            cert = book.certificate_for(record.owner, now)
            if cert is None:
                continue
            cost += len(cert) + 48
        if size + cost > max_bytes and out:
            break
        out.append(record)
        owners.add(record.owner)
        size += cost
    return out
