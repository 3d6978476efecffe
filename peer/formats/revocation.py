"""A run's revocation list: the peers its authority (the coordinator) banned.

A certificate cannot be taken back once issued, so a ban needs a second signed statement:
:class:`RevocationList` names the banned peers' public keys, each until the last moment a
certificate issued to it before the ban could still be valid (after that the certificate
itself is dead and the entry can go). It is signed by the run authority, like the
certificates, and numbered: a list with a higher ``serial`` replaces a lower one, so an old
list cannot be replayed to lift a ban. Lists travel from the coordinator to each peer and
from peer to peer over their links; every node checks the signature itself, so relays need
no trust.

:class:`RevocationBook` is what a node keeps: the newest list it accepted. Pure, no I/O;
the node (``peer.node.core``) closes links, drops records and refuses handshakes with it.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field

import msgpack

from peer.exceptions import AuthenticationError
from peer.formats.identity import PUBLIC_KEY_SIZE, Identity, pack, verify_signature

__all__ = ["REVOCATION_CONTEXT", "RevocationBook", "RevocationList"]

REVOCATION_CONTEXT = b"swarmgrad/revocations/v1\x00"
MAX_ENTRIES = 100_000  # a list of a run's banned peers; far more than any run bans
MAX_LIST_BYTES = 8 << 20  # what a node accepts on a link


@dataclass(frozen=True, slots=True)
class RevocationList:
    """``entries``: ``(public_key, until)`` pairs, ``until`` a Unix time in seconds."""

    run_id: str
    serial: int
    entries: tuple[tuple[bytes, float], ...]
    signature: bytes = field(default=b"", repr=False)

    def signed_payload(self) -> bytes:
        body = pack(
            [self.run_id, int(self.serial), [[bytes(k), float(u)] for k, u in self.entries]]
        )
        return REVOCATION_CONTEXT + body

    @classmethod
    def issue(
        cls,
        authority: Identity,
        *,
        run_id: str,
        serial: int,
        entries: list[tuple[bytes, float]] | tuple[tuple[bytes, float], ...],
    ) -> RevocationList:
        """Sign a list with the run authority's key."""
        unsigned = cls(run_id, int(serial), _checked_entries(entries))
        return cls(
            unsigned.run_id,
            unsigned.serial,
            unsigned.entries,
            authority.sign(unsigned.signed_payload()),
        )

    def to_bytes(self) -> bytes:
        return pack(
            [self.run_id, int(self.serial), [[k, u] for k, u in self.entries], self.signature]
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> RevocationList:
        """Decode a list (the signature is not checked here: :meth:`verify`);
        :class:`AuthenticationError` if it is malformed."""
        if len(data) > MAX_LIST_BYTES:
            raise AuthenticationError(f"a revocation list is at most {MAX_LIST_BYTES} bytes")
        try:
            raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        except Exception as exc:
            raise AuthenticationError("a revocation list is not valid msgpack") from exc
        if not (isinstance(raw, list) and len(raw) == 4):
            raise AuthenticationError("a revocation list is [run_id, serial, entries, signature]")
        run_id, serial, entries, signature = raw
        if not (
            isinstance(run_id, str)
            and isinstance(serial, int)
            and not isinstance(serial, bool)
            and serial >= 0
            and isinstance(entries, list)
            and isinstance(signature, bytes)
        ):
            raise AuthenticationError("a revocation list's fields have the wrong types")
        try:
            checked = _checked_entries(entries)
        except ValueError as exc:
            raise AuthenticationError(f"a revocation list is malformed: {exc}") from None
        return cls(run_id, serial, checked, signature)

    def to_base64(self) -> str:
        return base64.urlsafe_b64encode(self.to_bytes()).decode("ascii")

    @classmethod
    def from_base64(cls, text: str) -> RevocationList:
        try:
            data = base64.urlsafe_b64decode(text.encode("ascii"))
        except Exception as exc:
            raise AuthenticationError("a revocation list is not valid base64") from exc
        return cls.from_bytes(data)

    def verify(self, run_public_key: bytes, run_id: str) -> None:
        """Raises :class:`AuthenticationError` unless this run's authority signed it."""
        if self.run_id != run_id:
            raise AuthenticationError(
                f"the revocation list is for run {self.run_id!r}, not {run_id!r}"
            )
        if not verify_signature(run_public_key, self.signature, self.signed_payload()):
            raise AuthenticationError("the revocation list is not signed by this run's authority")


def _checked_entries(entries: object) -> tuple[tuple[bytes, float], ...]:
    if not isinstance(entries, list | tuple) or len(entries) > MAX_ENTRIES:
        raise ValueError(f"entries must be a list of at most {MAX_ENTRIES}")
    out = []
    for entry in entries:
        if not (isinstance(entry, list | tuple) and len(entry) == 2):
            raise ValueError("an entry is [public_key, until]")
        key, until = entry
        if not (isinstance(key, bytes | bytearray) and len(key) == PUBLIC_KEY_SIZE):
            raise ValueError(f"an entry's key is {PUBLIC_KEY_SIZE} raw bytes")
        if isinstance(until, bool) or not isinstance(until, int | float) or math.isnan(until):
            raise ValueError("an entry's until is a number of seconds")
        out.append((bytes(key), float(until)))
    return tuple(out)


class RevocationBook:
    """The newest revocation list a node accepted, checked against the run's key."""

    def __init__(self, run_public_key: bytes, run_id: str) -> None:
        self.run_public_key = bytes(run_public_key)
        self.run_id = run_id
        self.current: RevocationList | None = None
        self._until: dict[bytes, float] = {}

    @property
    def serial(self) -> int:
        return -1 if self.current is None else self.current.serial

    def offer(self, data: bytes) -> RevocationList | None:
        """Accept ``data`` if it is a genuine list newer than the one held; returns it then,
        None for a list already known or older. :class:`AuthenticationError` for a list
        that is malformed or not signed by the run's authority."""
        revocations = RevocationList.from_bytes(data)
        if revocations.serial <= self.serial:
            return None
        revocations.verify(self.run_public_key, self.run_id)
        self.current = revocations
        self._until = {}
        for key, until in revocations.entries:
            self._until[key] = max(until, self._until.get(key, -math.inf))
        return revocations

    def revoked(self, public_key: bytes, now: float) -> bool:
        """Whether ``public_key`` is banned at Unix time ``now``."""
        until = self._until.get(bytes(public_key))
        return until is not None and until >= now

    def revoked_keys(self, now: float) -> list[bytes]:
        return [key for key, until in self._until.items() if until >= now]
