"""Identities, peer ids and run certificates."""

from __future__ import annotations

import pytest

from peer.exceptions import AuthenticationError
from peer.formats.identity import (
    Certificate,
    CertificateVerifier,
    Identity,
    SwarmKeyAuth,
    peer_id_from_public_key,
    verify_signature,
)


def test_peer_id_derives_from_public_key() -> None:
    ident = Identity()
    assert ident.peer_id == peer_id_from_public_key(ident.public_key)
    assert len(ident.peer_id) == 32 and ident.peer_id.isalnum()
    assert Identity.from_private_bytes(ident.private_bytes()).peer_id == ident.peer_id
    assert Identity().peer_id != ident.peer_id
    with pytest.raises(ValueError):
        peer_id_from_public_key(b"short")


def test_signatures() -> None:
    ident = Identity()
    sig = ident.sign(b"data")
    assert verify_signature(ident.public_key, sig, b"data")
    assert not verify_signature(ident.public_key, sig, b"other")
    assert not verify_signature(Identity().public_key, sig, b"data")
    assert not verify_signature(ident.public_key, b"x" * 3, b"data")


@pytest.fixture
def authority() -> Identity:
    return Identity()


def test_certificate_round_trip_and_verification(authority: Identity) -> None:
    peer = Identity()
    cert = Certificate.issue(
        authority, run_id="run-1", public_key=peer.public_key, role="peer", expires_at=2e9
    )
    assert Certificate.from_base64(cert.to_base64()) == cert
    verify = CertificateVerifier(authority.public_key, "run-1", clock=lambda: 1e9)
    assert verify(cert.to_bytes(), peer.public_key).role == "peer"


def test_a_certificates_volunteer_and_invite_are_signed(authority: Identity) -> None:
    """The volunteer and the invite travel signed: changing either breaks the signature, and
    a certificate naming only a volunteer signs what it signed before invites existed."""
    peer = Identity()
    verify = CertificateVerifier(authority.public_key, "run-1", clock=lambda: 1e9)
    issue = dict(run_id="run-1", public_key=peer.public_key, expires_at=2e9)
    cert = Certificate.issue(authority, **issue, volunteer="7", invite="tag-a")
    checked = verify(Certificate.from_base64(cert.to_base64()).to_bytes(), peer.public_key)
    assert (checked.volunteer, checked.invite) == ("7", "tag-a")
    for changed in (
        Certificate(**{**_fields(cert), "invite": "tag-b"}),
        Certificate(**{**_fields(cert), "invite": None}),
        Certificate(**{**_fields(cert), "volunteer": None}),
    ):
        with pytest.raises(AuthenticationError):
            verify(changed.to_bytes(), peer.public_key)
    only_volunteer = Certificate.issue(authority, **issue, volunteer="7")
    unsigned = Certificate("run-1", peer.public_key, "peer", 2e9, volunteer="7")
    assert only_volunteer.signed_payload() == unsigned.signed_payload()
    assert only_volunteer.invite is None and b"invite" not in only_volunteer.to_bytes()


def _fields(cert: Certificate) -> dict[str, object]:
    return {
        name: getattr(cert, name)
        for name in (
            "run_id",
            "public_key",
            "role",
            "expires_at",
            "signature",
            "volunteer",
            "invite",
        )
    }


def test_certificate_refusals(authority: Identity) -> None:
    peer = Identity()
    cert = Certificate.issue(
        authority, run_id="run-1", public_key=peer.public_key, expires_at=1000.0
    )
    now = 500.0
    with pytest.raises(AuthenticationError, match="not signed by this run"):
        CertificateVerifier(Identity().public_key, "run-1", clock=lambda: now)(
            cert.to_bytes(), peer.public_key
        )
    with pytest.raises(AuthenticationError, match="is for run 'run-1'"):
        CertificateVerifier(authority.public_key, "run-2", clock=lambda: now)(
            cert.to_bytes(), peer.public_key
        )
    with pytest.raises(AuthenticationError, match="different public key"):
        CertificateVerifier(authority.public_key, "run-1", clock=lambda: now)(
            cert.to_bytes(), Identity().public_key
        )
    with pytest.raises(AuthenticationError, match="expired"):
        CertificateVerifier(authority.public_key, "run-1", clock=lambda: 2000.0)(
            cert.to_bytes(), peer.public_key
        )
    with pytest.raises(AuthenticationError, match="role"):
        CertificateVerifier(
            authority.public_key, "run-1", allowed_roles=frozenset({"aux"}), clock=lambda: now
        )(cert.to_bytes(), peer.public_key)
    # Tampering with any signed field breaks the signature.
    forged = Certificate(cert.run_id, cert.public_key, "admin", cert.expires_at, cert.signature)
    with pytest.raises(AuthenticationError, match="not signed"):
        CertificateVerifier(authority.public_key, "run-1", clock=lambda: now)(
            forged.to_bytes(), peer.public_key
        )
    for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa1x\x01"):
        with pytest.raises(AuthenticationError):
            CertificateVerifier(authority.public_key, "run-1")(junk, peer.public_key)


def test_certificate_expiry_tolerates_small_clock_skew(authority: Identity) -> None:
    peer = Identity()
    cert = Certificate.issue(authority, run_id="r", public_key=peer.public_key, expires_at=1000.0)
    CertificateVerifier(authority.public_key, "r", max_clock_skew=5, clock=lambda: 1004.0)(
        cert.to_bytes(), peer.public_key
    )


def test_swarm_key_must_be_long_enough() -> None:
    with pytest.raises(ValueError, match="16 random bytes"):
        SwarmKeyAuth(b"short")
    assert "kkkk" not in repr(SwarmKeyAuth(b"k" * 32)), "the secret must not show in logs"
