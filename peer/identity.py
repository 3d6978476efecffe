"""The older name of :mod:`peer.formats.identity` (keys, certificates, join proofs, the nodes'
authentication modes), kept so that existing imports go on working."""

from __future__ import annotations

from peer.formats.identity import (
    CERTIFICATE_CONTEXT,
    JOIN_PROOF_CONTEXT,
    PEER_ID_LENGTH,
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    Authenticator,
    Certificate,
    CertificateAuth,
    CertificateVerifier,
    CertificateVerify,
    Identity,
    OpenAuth,
    SwarmKeyAuth,
    is_peer_id,
    join_proof_payload,
    peer_id_from_public_key,
    verify_signature,
)

__all__ = [
    "CERTIFICATE_CONTEXT",
    "JOIN_PROOF_CONTEXT",
    "PEER_ID_LENGTH",
    "PUBLIC_KEY_SIZE",
    "SIGNATURE_SIZE",
    "Authenticator",
    "Certificate",
    "CertificateAuth",
    "CertificateVerifier",
    "CertificateVerify",
    "Identity",
    "OpenAuth",
    "SwarmKeyAuth",
    "is_peer_id",
    "join_proof_payload",
    "peer_id_from_public_key",
    "verify_signature",
]
