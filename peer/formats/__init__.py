"""The formats the coordinator and the volunteer share, and nothing else.

- :mod:`~peer.formats.identity`: key pairs, peer ids, run certificates, the join proof, the
  nodes' three authentication modes; :mod:`~peer.formats.revocation`: a run's signed bans;
- :mod:`~peer.formats.requests` and :mod:`~peer.formats.payloads`: the REST bodies a client
  sends and the answers it reads, the very classes the coordinator's routes validate;
- :mod:`~peer.formats.run_config`: the settings every run shares, and their checks;
- :mod:`~peer.formats.durations`, :mod:`~peer.formats.rates`, :mod:`~peer.formats.task_files`,
  :mod:`~peer.formats.open_types`: durations as typed, counted rates, shipped task files, and
  the names of the few values whose type really is open.

Both sides import these modules, so they import only the standard library, ``msgpack``,
``cryptography``, ``pydantic`` and :mod:`peer.exceptions` (``tests/test_layers.py`` checks).
"""

from __future__ import annotations

from peer.formats.identity import (
    Certificate,
    CertificateAuth,
    CertificateVerifier,
    Identity,
    OpenAuth,
    SwarmKeyAuth,
    join_proof_payload,
)
from peer.formats.revocation import RevocationBook, RevocationList

__all__ = [
    "Certificate",
    "CertificateAuth",
    "CertificateVerifier",
    "Identity",
    "OpenAuth",
    "RevocationBook",
    "RevocationList",
    "SwarmKeyAuth",
    "join_proof_payload",
]
