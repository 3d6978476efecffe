"""The older name of :mod:`peer.formats.revocation` (a run's signed list of banned peers),
kept so that existing imports go on working."""

from __future__ import annotations

from peer.formats.revocation import (
    MAX_ENTRIES,
    MAX_LIST_BYTES,
    REVOCATION_CONTEXT,
    RevocationBook,
    RevocationList,
)

__all__ = [
    "MAX_ENTRIES",
    "MAX_LIST_BYTES",
    "REVOCATION_CONTEXT",
    "RevocationBook",
    "RevocationList",
]
