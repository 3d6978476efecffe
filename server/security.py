"""Token format and hashing, encryption of run signing keys at rest, and join challenges.

A token reads ``sg<scope letter>_<id>_<secret>``: the id (16 hex characters, not secret)
finds the row, then SHA-256 of the secret is compared in constant time with the stored
hash. The secret has 256 bits of entropy, so a fast unsalted hash is enough (no
dictionary to attack); only the hash is stored, and the full token is shown exactly once.

Keys for the other uses (:class:`KeyBox`, :class:`JoinChallenges`) are derived from the
server secret by HKDF, one per purpose (:func:`derive_key`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import hmac as crypto_hmac
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from server.clock import now_ms
from server.models import TokenScope

_SCOPE_LETTER = {TokenScope.organizer: "o", TokenScope.join: "j", TokenScope.peer: "p"}
_LETTER_SCOPE = {letter: scope for scope, letter in _SCOPE_LETTER.items()}
TOKEN_ID_HEX = 16
_NONCE_SIZE = 12


@dataclass(frozen=True, slots=True)
class NewToken:
    """A freshly minted token: give ``plaintext`` to its holder, store the rest."""

    id: str
    plaintext: str
    secret_hash: bytes


@dataclass(frozen=True, slots=True)
class ParsedToken:
    scope: TokenScope
    id: str
    secret: str


def hash_secret(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def mint_token(scope: TokenScope) -> NewToken:
    token_id = secrets.token_hex(TOKEN_ID_HEX // 2)
    secret = secrets.token_urlsafe(32)
    return NewToken(token_id, f"sg{_SCOPE_LETTER[scope]}_{token_id}_{secret}", hash_secret(secret))


def parse_token(text: str) -> ParsedToken | None:
    """Split a presented token; ``None`` when it cannot be one of ours."""
    parts = text.split("_", 2)
    if len(parts) != 3 or len(parts[0]) != 3 or not parts[0].startswith("sg"):
        return None
    scope = _LETTER_SCOPE.get(parts[0][2])
    token_id, secret = parts[1], parts[2]
    if scope is None or len(token_id) != TOKEN_ID_HEX or not secret or len(secret) > 128:
        return None
    return ParsedToken(scope, token_id, secret)


def secret_matches(secret: str, stored_hash: bytes) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def constant_time_equals(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))


def derive_key(server_secret: str, purpose: bytes) -> bytes:
    """A 256-bit key for one ``purpose``, derived from the server secret by HKDF-SHA256
    (RFC 5869); keys for different purposes are independent."""
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=b"swarmgrad/keybox/v1", info=purpose
    ).derive(server_secret.encode("utf-8"))


class KeyBox:
    """AES-256-GCM with a key derived from the server secret (:func:`derive_key`).

    ``associated_data`` binds a ciphertext to its row (the run id), so a key copied onto
    another run does not decrypt. During a rotation of the server secret, ``previous`` is
    the old one: :meth:`open` tries the current key, then the previous one; :meth:`seal`
    always uses the current one, and :meth:`reseal` moves a ciphertext onto it.
    """

    def __init__(self, server_secret: str, previous: str | None = None) -> None:
        purpose = b"run-authority-private-key"
        self._aead = AESGCM(derive_key(server_secret, purpose))
        self._previous = (
            AESGCM(derive_key(previous, purpose))
            if previous is not None and previous != server_secret
            else None
        )

    def seal(self, plaintext: bytes, associated_data: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE_SIZE)
        return nonce + self._aead.encrypt(nonce, plaintext, associated_data)

    def open(self, sealed: bytes, associated_data: bytes) -> bytes:
        """Decrypt; raises ``ValueError`` if neither the secret nor the previous one (when
        set) sealed it, or the data was altered."""
        return self._open(sealed, associated_data)[0]

    def reseal(self, sealed: bytes, associated_data: bytes) -> bytes | None:
        """The plaintext sealed again under the current secret if ``sealed`` opens only under
        the previous one; ``None`` if it already opens under the current one. ``ValueError``
        if it opens under neither."""
        plaintext, current = self._open(sealed, associated_data)
        return None if current else self.seal(plaintext, associated_data)

    def _open(self, sealed: bytes, associated_data: bytes) -> tuple[bytes, bool]:
        nonce, body = sealed[:_NONCE_SIZE], sealed[_NONCE_SIZE:]
        try:
            return self._aead.decrypt(nonce, body, associated_data), True
        except InvalidTag:
            pass
        if self._previous is not None:
            try:
                return self._previous.decrypt(nonce, body, associated_data), False
            except InvalidTag:
                pass
        raise ValueError(
            "cannot decrypt the run's signing key: SWARMGRAD_SECRET_KEY"
            + (" and SWARMGRAD_SECRET_KEY_PREVIOUS differ" if self._previous else " differs")
            + " from the one the run was created with"
        )


class ChallengeRefused(ValueError):
    """A join challenge that must not be accepted; ``str()`` says why, for the caller."""


@dataclass(frozen=True, slots=True)
class JoinChallenge:
    text: str
    run_id: str
    token_id: str
    expires_ms: int


_CHALLENGE_CONTEXT = b"swarmgrad-join-challenge-v1\x00"
_CHALLENGE_VERSION = 1
_CHALLENGE_NONCE_SIZE = 16


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text.encode("ascii") + b"=" * (-len(text) % 4))


class JoinChallenges:
    """Stateless join challenges, so that any worker can check what another one issued.

    A challenge reads ``<body>.<tag>`` (urlsafe base64): the body is msgpack of
    ``[version, run id, join token id, expiry in Unix ms, 16 random bytes]``, the tag its
    HMAC-SHA256 under a key derived from the server secret (:func:`derive_key`); during a
    rotation, a tag under the ``previous`` secret is accepted too. It binds a
    join to one run, one invite and a short time; the random part makes every challenge,
    and so every signature over it, different. Nothing is stored: a challenge can be used
    several times until it expires (each use still needs the joiner's signature).
    """

    def __init__(
        self,
        server_secret: str,
        ttl_s: float,
        clock: Callable[[], int] = now_ms,
        previous: str | None = None,
    ) -> None:
        self._key = derive_key(server_secret, b"join-challenge-mac")
        self._previous_key = (
            derive_key(previous, b"join-challenge-mac")
            if previous is not None and previous != server_secret
            else None
        )
        self._ttl_ms = int(ttl_s * 1000)
        self._clock = clock

    def _tag(self, body: bytes, key: bytes | None = None) -> crypto_hmac.HMAC:
        mac = crypto_hmac.HMAC(key or self._key, hashes.SHA256())
        mac.update(_CHALLENGE_CONTEXT + body)
        return mac

    def _verify(self, body: bytes, tag: bytes) -> None:
        try:
            self._tag(body).verify(tag)
        except InvalidSignature:
            if self._previous_key is None:
                raise
            self._tag(body, self._previous_key).verify(tag)

    def issue(self, run_id: str, token_id: str) -> JoinChallenge:
        expires_ms = self._clock() + self._ttl_ms
        body = msgpack.packb(
            [
                _CHALLENGE_VERSION,
                run_id,
                token_id,
                expires_ms,
                secrets.token_bytes(_CHALLENGE_NONCE_SIZE),
            ],
            use_bin_type=True,
        )
        text = f"{_b64(body)}.{_b64(self._tag(body).finalize())}"
        return JoinChallenge(text, run_id, token_id, expires_ms)

    def check(self, text: str, *, run_id: str, token_id: str) -> JoinChallenge:
        """The challenge if it is genuine, unexpired and for this run and join token;
        :class:`ChallengeRefused` otherwise."""
        body_text, _, tag_text = text.partition(".")
        try:
            body, tag = _unb64(body_text), _unb64(tag_text)
            self._verify(body, tag)
            version, issued_run, issued_token, expires_ms, _nonce = msgpack.unpackb(body)
        except (ValueError, TypeError, InvalidSignature):  # binascii.Error is a ValueError
            raise ChallengeRefused(
                "the join challenge is not one this coordinator issued"
            ) from None
        if version != _CHALLENGE_VERSION:
            raise ChallengeRefused("the join challenge is of an unknown version")
        if issued_run != run_id or issued_token != token_id:
            raise ChallengeRefused("the join challenge was issued for another run or invite")
        if not isinstance(expires_ms, int) or expires_ms <= self._clock():
            raise ChallengeRefused("the join challenge has expired")
        return JoinChallenge(text, run_id, token_id, expires_ms)


class PrincipalCache:
    """Recently verified tokens of one worker process, for at most ``ttl_s`` seconds (and
    never past the token's own expiry, when :meth:`put` is told it).

    Only successful verifications are kept, keyed by token id with the secret's hash, so a
    hit still needs the right secret (compared in constant time). Bounded: when full, the
    oldest entries go first. What the database revokes meanwhile is taken out by
    :meth:`evict` and :meth:`evict_run` (:mod:`server.services.revocation_sweep` calls them).
    """

    def __init__(
        self, ttl_s: float, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ttl = ttl_s
        self._max = max_entries
        self._clock = clock
        # token id -> (secret's hash, valid until (clock), value, run id)
        self._entries: dict[str, tuple[bytes, float, object, str | None]] = {}

    def get(self, token_id: str, secret: str) -> object | None:
        if self._ttl <= 0:
            return None
        entry = self._entries.get(token_id)
        if entry is None:
            return None
        stored_hash, until, value, _ = entry
        if self._clock() > until:
            self._entries.pop(token_id, None)
            return None
        return value if secret_matches(secret, stored_hash) else None

    def put(
        self,
        token_id: str,
        secret: str,
        value: object,
        *,
        run_id: str | None = None,
        expires_in_s: float | None = None,
    ) -> None:
        """Keep ``value`` for ``ttl_s`` (or ``expires_in_s``, the token's remaining life, if
        shorter); ``run_id`` lets :meth:`evict_run` find it."""
        if self._ttl <= 0:
            return
        if len(self._entries) >= self._max:
            # dicts keep insertion order: drop the oldest tenth in one go.
            for key in list(itertools.islice(self._entries, self._max // 10 + 1)):
                del self._entries[key]
        life = self._ttl if expires_in_s is None else min(self._ttl, expires_in_s)
        self._entries.pop(token_id, None)
        self._entries[token_id] = (hash_secret(secret), self._clock() + life, value, run_id)

    def put_verified(
        self,
        token_id: str,
        secret_hash: bytes,
        value: object,
        *,
        run_id: str | None = None,
        expires_in_s: float | None = None,
    ) -> None:
        """As :meth:`put`, for a token read from the database (its stored hash, not its
        secret): a request still has to present the secret that hashes to it."""
        if self._ttl <= 0:
            return
        if len(self._entries) >= self._max:
            for key in list(itertools.islice(self._entries, self._max // 10 + 1)):
                del self._entries[key]
        life = self._ttl if expires_in_s is None else min(self._ttl, expires_in_s)
        self._entries.pop(token_id, None)
        self._entries[token_id] = (secret_hash, self._clock() + life, value, run_id)

    def evict(self, token_ids: Iterable[str]) -> int:
        """Forget these tokens; how many were kept."""
        return sum(self._entries.pop(t, None) is not None for t in token_ids)

    def evict_run(self, run_id: str) -> int:
        """Forget every token of this run; how many were kept."""
        gone = [t for t, entry in self._entries.items() if entry[3] == run_id]
        return self.evict(gone)

    def __len__(self) -> int:
        return len(self._entries)
