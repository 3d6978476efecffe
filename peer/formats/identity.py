"""Peer identity, authentication modes and run certificates.

Every node has an Ed25519 key pair; its peer id is derived from the public key
(``base32(sha256(public_key))[:32]``, lower case), so anyone holding a public key can
check which peer id it belongs to without asking anybody.

Authentication is one of three explicit modes, chosen when the node is built and never
downgraded silently:

* :class:`OpenAuth` — no credential; peers still prove they hold the private key of their
  peer id, but anyone may join. For local experiments.
* :class:`SwarmKeyAuth` — a pre-shared secret; both sides prove knowledge of it with an
  HMAC over the handshake transcript.
* :class:`CertificateAuth` — a run authority (the coordinator) signs a :class:`Certificate`
  over the peer's public key, run id, role and expiry; :class:`CertificateVerifier` checks
  one against the run's public key.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from peer.exceptions import AuthenticationError

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
PEER_ID_LENGTH = 32

CERTIFICATE_CONTEXT = b"swarmgrad/certificate/v1\x00"
_PEER_ID = re.compile(f"[a-z2-7]{{{PEER_ID_LENGTH}}}")  # base32, lower case


def pack(value: object) -> bytes:
    """``value`` as msgpack, bytes as its bin type: what the signed formats sign."""
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def is_peer_id(value: object) -> bool:
    """Whether ``value`` has the form of a peer id (not whether such a peer exists)."""
    return isinstance(value, str) and _PEER_ID.fullmatch(value) is not None


def peer_id_from_public_key(public_key: bytes) -> str:
    """The peer id that belongs to a raw 32-byte Ed25519 public key."""
    if not isinstance(public_key, bytes | bytearray) or len(public_key) != PUBLIC_KEY_SIZE:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_SIZE} raw bytes")
    return _peer_id(bytes(public_key))


@functools.lru_cache(maxsize=4096)
def _peer_id(public_key: bytes) -> str:
    digest = hashlib.sha256(public_key).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:PEER_ID_LENGTH]


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True when ``signature`` is ``public_key``'s Ed25519 signature of ``data``."""
    if len(public_key) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
        return False
    return _VERIFIED.check(bytes(public_key), bytes(signature), data)


class _VerifiedSignatures:
    """Recently verified signatures, so a gossip record that arrives from several peers
    within a round is checked once.

    Keyed by a 32-byte digest of (key, signature, data), never by the data itself (which
    the sender chooses and may be megabytes), and only successes are kept: a stream of
    forged messages costs one verification each and leaves nothing behind. At most
    ``max_entries`` (least recently used go first): ~1 MiB in all."""

    def __init__(self, max_entries: int = 8192) -> None:
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # nodes on several loop threads share one process

    def check(self, public_key: bytes, signature: bytes, data: bytes | memoryview) -> bool:
        # key and signature have fixed sizes (checked by the caller): the concatenation
        # is unambiguous
        h = hashlib.blake2b(public_key, digest_size=32)
        h.update(signature)
        h.update(data)
        digest = h.digest()
        with self._lock:
            if digest in self._seen:
                self._seen.move_to_end(digest)
                return True
        try:
            Ed25519PublicKey.from_public_bytes(public_key).verify(signature, bytes(data))
        except (InvalidSignature, ValueError):
            return False
        with self._lock:
            self._seen[digest] = None
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._seen)


_VERIFIED = _VerifiedSignatures()


class Identity:
    """An Ed25519 key pair and the peer id derived from it."""

    __slots__ = ("_private_key", "peer_id", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey | None = None) -> None:
        self._private_key = private_key or Ed25519PrivateKey.generate()
        self.public_key: bytes = self._private_key.public_key().public_bytes(
            Encoding.Raw, PublicFormat.Raw
        )
        self.peer_id: str = peer_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls()

    @classmethod
    def from_private_bytes(cls, data: bytes) -> Identity:
        """Rebuild an identity from the 32 raw private-key bytes of :meth:`private_bytes`."""
        try:
            return cls(Ed25519PrivateKey.from_private_bytes(bytes(data)))
        except ValueError as exc:
            raise ValueError("an Ed25519 private key is 32 raw bytes") from exc

    def private_bytes(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

        return self._private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"


# --------------------------------------------------------------------------- certificates


@dataclass(frozen=True, slots=True)
class Certificate:
    """A run authority's signature over a peer's public key, run id, role and expiry.

    ``expires_at`` is a Unix time in seconds. ``role`` is free-form for the authority
    (the coordinator uses ``"peer"``, ``"client"`` and ``"auxiliary"``). ``volunteer``
    names the person (the coordinator's volunteer id) the key belongs to, so several keys
    of one person can be counted as one; ``invite`` names the invite that admitted that
    volunteer (an opaque tag: the volunteers one shared invite admitted cannot be told
    apart, so peers counting witnesses count them as one). Each is signed when present, and
    a certificate without them signs the same bytes as before the fields existed.
    """

    run_id: str
    public_key: bytes
    role: str
    expires_at: float
    signature: bytes = field(default=b"", repr=False)
    volunteer: str | None = None
    invite: str | None = None

    def signed_payload(self) -> bytes:
        fields: list[object] = [
            self.run_id,
            bytes(self.public_key),
            self.role,
            float(self.expires_at),
        ]
        if self.volunteer is not None or self.invite is not None:
            fields.append(self.volunteer)
        if self.invite is not None:  # six fields: never read as a volunteer-only payload
            fields.append(self.invite)
        return CERTIFICATE_CONTEXT + pack(fields)

    @classmethod
    def issue(
        cls,
        authority: Identity,
        *,
        run_id: str,
        public_key: bytes,
        role: str = "peer",
        expires_at: float,
        volunteer: str | None = None,
        invite: str | None = None,
    ) -> Certificate:
        """Sign a certificate for ``public_key`` with the run authority's key."""
        if len(public_key) != PUBLIC_KEY_SIZE:
            raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_SIZE} raw bytes")
        unsigned = cls(
            run_id, bytes(public_key), role, float(expires_at), volunteer=volunteer, invite=invite
        )
        return cls(
            run_id,
            bytes(public_key),
            role,
            float(expires_at),
            authority.sign(unsigned.signed_payload()),
            volunteer=volunteer,
            invite=invite,
        )

    def to_bytes(self) -> bytes:
        raw: dict[str, object] = {
            "run_id": self.run_id,
            "public_key": self.public_key,
            "role": self.role,
            "expires_at": float(self.expires_at),
            "signature": self.signature,
        }
        if self.volunteer is not None:
            raw["volunteer"] = self.volunteer
        if self.invite is not None:
            raw["invite"] = self.invite
        return pack(raw)

    @classmethod
    def from_bytes(cls, data: bytes) -> Certificate:
        """Decode a certificate; raises :class:`AuthenticationError` if it is malformed."""
        try:
            raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        except Exception as exc:
            raise AuthenticationError("certificate is not valid msgpack") from exc
        if not isinstance(raw, dict):
            raise AuthenticationError("certificate must be a map")
        try:
            cert = cls(
                run_id=raw["run_id"],
                public_key=raw["public_key"],
                role=raw["role"],
                expires_at=raw["expires_at"],
                signature=raw["signature"],
                volunteer=raw.get("volunteer"),
                invite=raw.get("invite"),
            )
        except KeyError as exc:
            raise AuthenticationError(f"certificate lacks field {exc.args[0]!r}") from exc
        if not (
            isinstance(cert.run_id, str)
            and isinstance(cert.public_key, bytes)
            and isinstance(cert.role, str)
            and isinstance(cert.expires_at, int | float)
            and isinstance(cert.signature, bytes)
            and (cert.volunteer is None or isinstance(cert.volunteer, str))
            and (cert.invite is None or isinstance(cert.invite, str))
        ):
            raise AuthenticationError("certificate fields have the wrong types")
        return cert

    def to_base64(self) -> str:
        return base64.urlsafe_b64encode(self.to_bytes()).decode("ascii")

    @classmethod
    def from_base64(cls, text: str) -> Certificate:
        try:
            data = base64.urlsafe_b64decode(text.encode("ascii"))
        except Exception as exc:
            raise AuthenticationError("certificate is not valid base64") from exc
        return cls.from_bytes(data)


CertificateVerify = Callable[[bytes, bytes], Any]
"""``verify(certificate_bytes, peer_public_key)``: returns on success, raises
:class:`AuthenticationError` when the certificate must be refused."""


@dataclass(frozen=True, slots=True)
class CertificateVerifier:
    """Standard certificate check: signed by ``run_public_key``, for ``run_id``, unexpired,
    issued to the connecting peer's key, and (optionally) of an allowed role.

    ``max_clock_skew`` seconds of tolerance are granted on the expiry, so a peer whose clock
    runs slightly ahead does not refuse certificates that are about to expire.
    """

    run_public_key: bytes
    run_id: str
    allowed_roles: frozenset[str] | None = None
    max_clock_skew: float = 5.0
    clock: Callable[[], float] = time.time

    def __call__(self, certificate: bytes, peer_public_key: bytes) -> Certificate:
        cert = Certificate.from_bytes(certificate)
        if not verify_signature(self.run_public_key, cert.signature, cert.signed_payload()):
            raise AuthenticationError("certificate is not signed by this run's authority")
        if cert.run_id != self.run_id:
            raise AuthenticationError(
                f"certificate is for run {cert.run_id!r}, not {self.run_id!r}"
            )
        if not hmac.compare_digest(cert.public_key, bytes(peer_public_key)):
            raise AuthenticationError("certificate was issued to a different public key")
        if cert.expires_at + self.max_clock_skew < self.clock():
            raise AuthenticationError("certificate has expired; ask the coordinator for a new one")
        if self.allowed_roles is not None and cert.role not in self.allowed_roles:
            raise AuthenticationError(f"certificate role {cert.role!r} is not allowed here")
        return cert


# --------------------------------------------------------------------------- join proof

JOIN_PROOF_CONTEXT = b"swarmgrad-join-proof-v1\x00"


def join_proof_payload(run_id: str, challenge: str, public_key: bytes) -> bytes:
    """What a volunteer signs with :meth:`Identity.sign` to join a run: it proves to the
    coordinator that the joiner holds the private key of ``public_key``, for this run and
    this challenge only (``POST /api/v1/join/challenge`` hands out the challenge)."""
    return JOIN_PROOF_CONTEXT + pack([run_id, challenge, bytes(public_key)])


# --------------------------------------------------------------------------- auth modes


@dataclass(frozen=True, slots=True)
class OpenAuth:
    """No credential: anyone who holds a key pair may connect. For local experiments only."""

    mode: str = field(default="open", init=False)


@dataclass(frozen=True, slots=True)
class SwarmKeyAuth:
    """Pre-shared swarm key: both sides prove knowledge of ``key`` during the handshake."""

    key: bytes = field(repr=False)
    mode: str = field(default="swarm-key", init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) < 16:
            raise ValueError(
                "a swarm key is at least 16 random bytes (e.g. secrets.token_bytes(32))"
            )

    def proof(self, transcript: bytes) -> bytes:
        return hmac.new(self.key, transcript, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class CertificateAuth:
    """Run certificates: present ``certificate`` (bytes of :class:`Certificate`) and check the
    other side's with ``verify`` (e.g. a :class:`CertificateVerifier`)."""

    certificate: bytes = field(repr=False)
    verify: CertificateVerify = field(repr=False)
    mode: str = field(default="certificate", init=False)


Authenticator = OpenAuth | SwarmKeyAuth | CertificateAuth
