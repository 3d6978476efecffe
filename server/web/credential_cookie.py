"""The credential a browser got from an invite page, kept by that browser so the page can be
shown again without issuing another.

The invite page follows POST/redirect/GET: the POST spends one use of the invite and answers
with a redirect to ``/join/{invite}/credential``, which shows the credential. The coordinator
keeps only a hash of it, so the plaintext travels back to the browser sealed (AES-256-GCM,
key derived from the server secret, bound to the invite's id) in an HttpOnly, SameSite=Strict
cookie scoped to that invite's path and kept :data:`KEEP_S`. A reload, or the form sent again,
finds the cookie and shows the same credential: nothing new is issued, no use is spent."""

from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from server.security import derive_key

COOKIE_PREFIX = "swarmgrad_credential_"
KEEP_S = 3600  # how long the browser can see its credential again
_NONCE = 12


@dataclass(frozen=True, slots=True)
class KeptCredential:
    volunteer_id: int
    token: str


def cookie_name(invite_id: str) -> str:
    return COOKIE_PREFIX + invite_id


def cookie_path(invite: str) -> str:
    return f"/join/{invite}"


class CredentialSeal:
    def __init__(self, server_secret: str) -> None:
        self._aead = AESGCM(derive_key(server_secret, b"swarmgrad/page-credential"))

    def seal(self, invite_id: str, credential: KeptCredential, *, now: float | None = None) -> str:
        body = json.dumps(
            {
                "v": credential.volunteer_id,
                "t": credential.token,
                "e": (time.time() if now is None else now) + KEEP_S,
            }
        ).encode()
        nonce = secrets.token_bytes(_NONCE)
        sealed = nonce + self._aead.encrypt(nonce, body, invite_id.encode())
        return base64.urlsafe_b64encode(sealed).decode().rstrip("=")

    def open(
        self, invite_id: str, text: str | None, *, now: float | None = None
    ) -> KeptCredential | None:
        """The credential sealed for this invite, or None (absent, altered, another invite's,
        or older than :data:`KEEP_S`)."""
        if not text or len(text) > 1024:
            return None
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            body = json.loads(self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], invite_id.encode()))
            credential = KeptCredential(int(body["v"]), str(body["t"]))
            expires = float(body["e"])
        except (ValueError, KeyError, TypeError, InvalidTag):
            return None
        if (time.time() if now is None else now) > expires:
            return None
        return credential
