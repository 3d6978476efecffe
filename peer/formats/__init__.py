"""The formats the coordinator and the volunteer share, and nothing else.

- :mod:`peer.formats.identity`: key pairs and peer ids, run certificates (what the coordinator
  signs, what every peer verifies), the join proof a volunteer signs, the nodes' three
  authentication modes;
- :mod:`peer.formats.revocation`: a run's signed list of banned peers;
- :mod:`peer.formats.payloads`: the REST payloads the volunteer's side reads or sends, the
  very classes the coordinator's routes validate and document;
- :mod:`peer.formats.durations`: durations as both command lines take them.

Both sides import these modules: the coordinator (``server``) to issue, sign and validate,
the peer library to present, verify and parse. So they import only the standard library,
``msgpack``, ``cryptography``, ``pydantic`` and :mod:`peer.exceptions` — never the node, the
transports, torch or the server stack (``tests/test_layers.py`` walks the imports). ``peer.identity`` and
``peer.revocation`` are the older names of the two modules and stay importable.
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
