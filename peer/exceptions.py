"""Exceptions raised by the peer library.

Hierarchy::

    SwarmgradError
    ├── ProtocolError              a remote peer broke the wire protocol
    │   ├── MalformedFrame         bytes that do not decode into a valid frame
    │   ├── FrameTooLarge          header or payload over the configured limit
    │   ├── UnsupportedVersion     a protocol version this peer does not speak
    │   ├── UnknownMessageType     a message type nobody registered
    │   └── TamperedFrame          a sealed message failed authentication, or was replayed
    ├── AuthenticationError        handshake refused: bad signature, key, certificate or mode
    ├── TransportError             a connection could not be made or was lost
    │   ├── ConnectionClosed       the connection is closed (locally or by the remote)
    │   └── RelayRefused           a relay refused to register or connect a peer (its limits,
    │                              an unknown peer, a credential it does not accept)
    ├── RemoteError                the remote peer answered a request with an error
    └── NodeShutdown               the node was shut down while the call was in flight

Caller mistakes (a bad argument) raise ``ValueError``/``TypeError`` instead.
"""

from __future__ import annotations


class SwarmgradError(Exception):
    """Root of every error the peer library raises on purpose."""


class ProtocolError(SwarmgradError):
    """A remote peer sent something that breaks the wire protocol; its connection is closed."""


class MalformedFrame(ProtocolError):
    """The bytes received do not decode into a valid frame."""


class FrameTooLarge(ProtocolError):
    """A frame's header or payload is larger than the configured limit."""


class TamperedFrame(ProtocolError):
    """An encrypted message or lane record failed authentication (altered, forged by
    someone without the session's keys) or came again or out of order."""


class UnsupportedVersion(ProtocolError):
    """The frame carries a protocol version this peer does not speak."""


class UnknownMessageType(ProtocolError):
    """The frame's message type is not registered on this peer."""


class AuthenticationError(SwarmgradError):
    """The handshake failed: wrong swarm key, invalid certificate, bad signature or mode mismatch."""


class TransportError(SwarmgradError):
    """A connection could not be established or broke."""


class ConnectionClosed(TransportError):
    """The connection is closed; nothing more can be sent or received on it.

    ``clean`` is True when the other side closed it on purpose (a close handshake), False
    when it was lost (reset, crash, timeout)."""

    def __init__(self, message: str = "connection closed", *, clean: bool = False) -> None:
        super().__init__(message)
        self.clean = clean


class RelayRefused(TransportError):
    """A relay refused a request (:mod:`peer.transport.relay`): the reason says which limit
    or check, and what to do."""


class RemoteError(SwarmgradError):
    """The remote peer handled the request and answered with an error message."""


class NodeShutdown(SwarmgradError):
    """The node is shutting down or already shut down."""
