"""Authenticated links between two nodes: the handshake, then request/response and one-way
messages multiplexed over one transport connection.

:func:`handshake` authenticates both ends of a transport connection (swarm key, run
certificate or open mode, which must match, never downgraded) and agrees on the keys that
seal the link (:mod:`peer.transport.secure`); its docstring gives the messages and what each
proves. :class:`PeerLink` then carries frames: ``send`` for one-way messages, ``request``
for a reply; each frame received goes to the node's handler for its type. Until both ends
are authenticated no other frame is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from peer.exceptions import (
    AuthenticationError,
    ConnectionClosed,
    FrameTooLarge,
    NodeShutdown,
    ProtocolError,
    RemoteError,
    SwarmgradError,
    TransportError,
)
from peer.formats.identity import (
    PUBLIC_KEY_SIZE,
    Authenticator,
    CertificateAuth,
    Identity,
    SwarmKeyAuth,
    peer_id_from_public_key,
    verify_signature,
)
from peer.transport.base import Connection
from peer.transport.secure import (
    KX_BYTES,
    LINK_OVERHEAD,
    KeyExchange,
    SecureConnection,
    SessionKeys,
    derive_session,
)
from peer.wire import (
    BOOL,
    BYTES,
    STR,
    Frame,
    Limits,
    ListOf,
    MessageRegistry,
    Scalar,
    Schema,
    decode_frame,
    encode_frame,
    encode_header,
)

logger = logging.getLogger(__name__)

HANDSHAKE_CONTEXT = b"swarmgrad/handshake/v1\x00"

HELLO = "hello"
AUTH = "auth"
READY = "ready"
REFUSE = "refuse"
ERROR = "error"


def register_link_messages(registry: MessageRegistry) -> None:
    registry.register(
        HELLO,
        Schema(
            required={
                "public_key": Scalar(bytes, max_length=PUBLIC_KEY_SIZE),
                "nonce": Scalar(bytes, max_length=64),
                "mode": STR,
                "credential": Scalar(bytes, max_length=4096),
                "addresses": ListOf(Scalar(str, max_length=256), max_length=16),
                "client_mode": BOOL,
            },
            optional={
                "agent": Scalar(str, max_length=128),
                "encrypt": BOOL,
                "kx": Scalar(bytes, max_length=KX_BYTES),
            },
        ),
    )
    registry.register(
        AUTH, Schema(required={"signature": BYTES, "proof": Scalar(bytes, max_length=64)})
    )
    registry.register(READY, Schema())
    registry.register(REFUSE, Schema(required={"reason": Scalar(str, max_length=1024)}))
    registry.register(ERROR, Schema(required={"message": Scalar(str, max_length=4096)}))


@dataclass(frozen=True, slots=True)
class RemotePeer:
    """Who is on the other end of an authenticated link."""

    peer_id: str
    public_key: bytes
    addresses: tuple[str, ...]
    client_mode: bool
    credential: object = None  # what the certificate verifier returned, in certificate mode
    certificate: bytes = b""  # the certificate itself (certificate mode), to vouch for it


async def _recv_frame(
    conn: Connection, registry: MessageRegistry, limits: Limits
) -> tuple[Frame, bytes]:
    data = await conn.recv()
    return decode_frame(data, registry, limits), data


async def handshake(
    conn: Connection,
    *,
    identity: Identity,
    auth: Authenticator,
    addresses: list[str],
    client_mode: bool,
    registry: MessageRegistry,
    limits: Limits,
    timeout: float,
    expected_peer_id: str | None = None,
    encrypt: bool = True,
    refuse_key: Callable[[bytes], str | None] | None = None,
) -> tuple[RemotePeer, Connection]:
    """Authenticate both ends of ``conn``; the remote peer and the connection to use from
    now on (``conn`` sealed with the session's keys, unless ``encrypt`` is off).
    ``refuse_key(public_key)``, if given, names a reason to refuse the key the other side's
    hello shows (a ban), before anything else is done for it. Raises AuthenticationError
    (after telling the other side why) or ProtocolError/TransportError; the caller closes
    the connection on failure.

    Handshake (both sides run the same steps, so it does not matter who dialed)::

        → hello {public_key, nonce, mode, credential, addresses, client_mode, encrypt, kx}
        ← hello {...}
        → auth  {signature, proof}
        ← auth  {...}
        → ready {}
        ← ready {}

    Each side's ``auth`` signs ``context ‖ H(own hello) ‖ H(their hello)`` with its Ed25519
    key; the other side's fresh nonce inside ``their hello`` makes the signature useless for
    replay. In swarm-key mode ``proof`` is an HMAC of the same transcript under the shared key;
    in certificate mode ``credential`` is a run certificate checked with the pluggable verifier
    before anything else is accepted. Modes must match exactly; a mismatch is refused, never
    downgraded. Until both ``auth`` messages are verified, any other frame closes the
    connection: an unauthenticated peer cannot send a gossip record or a tensor.

    Pre-authentication limits: until the other side's ``auth`` has verified (its signature,
    and in swarm-key mode its proof of the swarm key), the transport refuses any message over
    :data:`~peer.transport.base.PRE_AUTH_MESSAGE_BYTES`, whatever certificate the hello
    showed (a certificate is public: any member's hello shows one). Each side raises the
    limit once the other's ``auth`` verifies and then says ``ready``; neither sends anything
    but handshake messages before it has read the other's ``ready``, so a large frame never
    meets the small limit.

    Encryption: ``kx`` is a fresh X25519 public key, signed with the rest of the hello, and the
    link's keys derive from the two (:mod:`peer.transport.secure`): every message after the
    handshake is sealed, so whoever relays a handshake can neither read the link nor inject a
    frame into it. ``encrypt`` says whether a peer seals its links (``False`` only on a trusted
    network, :attr:`~peer.node.core.NodeConfig.encryption`); both sides must agree, and a
    mismatch is refused like a mode mismatch.
    """
    try:
        async with asyncio.timeout(timeout):
            return await _handshake(
                conn,
                identity,
                auth,
                addresses,
                client_mode,
                registry,
                limits,
                expected_peer_id,
                encrypt,
                refuse_key,
            )
    except TimeoutError:
        raise AuthenticationError("handshake timed out") from None


async def _handshake(
    conn: Connection,
    identity: Identity,
    auth: Authenticator,
    addresses: list[str],
    client_mode: bool,
    registry: MessageRegistry,
    limits: Limits,
    expected_peer_id: str | None,
    encrypt: bool,
    refuse_key: Callable[[bytes], str | None] | None,
) -> tuple[RemotePeer, Connection]:
    credential = auth.certificate if isinstance(auth, CertificateAuth) else b""
    kx = KeyExchange() if encrypt else None
    my_hello = encode_frame(
        Frame(
            HELLO,
            {
                "public_key": identity.public_key,
                "nonce": secrets.token_bytes(32),
                "mode": auth.mode,
                "credential": credential,
                "addresses": list(addresses),
                "client_mode": client_mode,
                "agent": "swarmgrad/0.1",
                "encrypt": encrypt,
                "kx": kx.public if kx is not None else b"",
            },
        ),
        limits,
    )
    await conn.send(my_hello)

    frame, their_hello = await _recv_frame(conn, registry, limits)
    if frame.type == REFUSE:
        raise AuthenticationError(f"refused by remote peer: {frame.fields['reason']}")
    if frame.type != HELLO:
        await _refuse(conn, f"expected {HELLO!r} first, got {frame.type!r}", limits)
    fields = frame.fields
    their_key: bytes = fields["public_key"]
    if len(their_key) != PUBLIC_KEY_SIZE:
        await _refuse(conn, "public key must be 32 bytes", limits)
    their_id = peer_id_from_public_key(their_key)
    if their_key == identity.public_key:
        await _refuse(conn, "connected to itself", limits)
    if expected_peer_id is not None and their_id != expected_peer_id:
        await _refuse(conn, f"expected peer {expected_peer_id}, reached {their_id}", limits)
    refusal = refuse_key(their_key) if refuse_key is not None else None
    if refusal is not None:
        await _refuse(conn, refusal, limits)
    if fields["mode"] != auth.mode:
        await _refuse(
            conn,
            f"authentication mode mismatch: this swarm uses {auth.mode!r}, not {fields['mode']!r}",
            limits,
        )
    their_encrypt = fields.get("encrypt", False)
    if their_encrypt != encrypt:
        here, there = ("encrypts", "does not") if encrypt else ("does not encrypt", "does")
        await _refuse(
            conn,
            f"link encryption mismatch: peer {identity.peer_id} {here} its links and peer "
            f"{their_id} {there} (encryption=False is for trusted networks, and every peer "
            "of a swarm must agree on it)",
            limits,
        )
    verified: object = None
    if isinstance(auth, CertificateAuth):
        try:
            verified = auth.verify(fields["credential"], their_key)
        except AuthenticationError as exc:
            await _refuse(conn, f"certificate refused: {exc}", limits)
        except Exception as exc:  # a verifier is user code: never let it crash the node
            await _refuse(conn, f"certificate refused: {type(exc).__name__}: {exc}", limits)
    shared = b""
    if kx is not None:
        try:
            shared = kx.shared(fields.get("kx", b""))
        except ValueError as exc:
            await _refuse(conn, f"bad key-exchange key: {exc}", limits)

    def transcript(first: bytes, second: bytes) -> bytes:
        return HANDSHAKE_CONTEXT + hashlib.sha256(first).digest() + hashlib.sha256(second).digest()

    mine = transcript(my_hello, their_hello)
    proof = auth.proof(mine) if isinstance(auth, SwarmKeyAuth) else b""
    await conn.send(
        encode_frame(Frame(AUTH, {"signature": identity.sign(mine), "proof": proof}), limits)
    )

    frame, _ = await _recv_frame(conn, registry, limits)
    if frame.type == REFUSE:
        raise AuthenticationError(f"refused by remote peer: {frame.fields['reason']}")
    if frame.type != AUTH:
        await _refuse(conn, f"expected {AUTH!r}, got {frame.type!r}", limits)
    theirs = transcript(their_hello, my_hello)
    if not verify_signature(their_key, frame.fields["signature"], theirs):
        await _refuse(conn, "handshake signature does not verify", limits)
    if isinstance(auth, SwarmKeyAuth) and not hmac.compare_digest(
        frame.fields["proof"], auth.proof(theirs)
    ):
        await _refuse(conn, "wrong swarm key", limits)
    # Only now has the peer proven that it holds its key (and the swarm key): from here on
    # it may send full-size frames. A certificate alone proves nothing, since any member's
    # hello shows one. The limit rises before our ``ready`` goes out, and the peer sends
    # nothing large before it reads that, so no large frame can meet the small limit.
    conn.limit_incoming(limits.max_frame_bytes + (LINK_OVERHEAD if encrypt else 0))
    remote = RemotePeer(
        their_id,
        their_key,
        tuple(fields["addresses"]),
        bool(fields["client_mode"]),
        verified,
        fields["credential"] if isinstance(auth, CertificateAuth) else b"",
    )
    if kx is not None:
        # the signatures just verified cover both hellos, their key-exchange keys included
        keys = derive_session(shared, identity.public_key, my_hello, their_key, their_hello)
        conn = SecureConnection(conn, keys)
    # ``ready`` (sealed when encrypting: it also confirms both ends derived the same keys)
    await conn.send(encode_frame(Frame(READY, {}), limits))
    frame, _ = await _recv_frame(conn, registry, limits)
    if frame.type == REFUSE:
        raise AuthenticationError(f"refused by remote peer: {frame.fields['reason']}")
    if frame.type != READY:
        await _refuse(conn, f"expected {READY!r}, got {frame.type!r}", limits)
    return remote, conn


async def _refuse(conn: Connection, reason: str, limits: Limits) -> None:
    with contextlib.suppress(SwarmgradError):
        await conn.send(encode_frame(Frame(REFUSE, {"reason": reason}), limits))
    raise AuthenticationError(reason)


Handler = Callable[["PeerLink", Frame], Awaitable[Frame | None]]


class PeerLink:
    """An authenticated connection: ``request()`` awaits a reply, ``send()`` is one-way.

    Incoming one-way messages are handled in arrival order by the reader (handlers must be
    quick: enqueue and return); requests each get a task, and their reply (or an ``error``
    frame if the handler raised ``ValueError``/``RemoteError``) goes back on this link.
    A protocol error from the remote closes the link with the reason.
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        conn: Connection,
        remote: RemotePeer,
        *,
        registry: MessageRegistry,
        limits: Limits,
        handlers: dict[str, Handler],
        on_close: Callable[[PeerLink, str, bool], None],  # (link, reason, lost unexpectedly)
        inbound: bool,
        on_sent: Callable[[int], None] | None = None,  # bytes of each frame sent
    ) -> None:
        self.conn = conn
        # the session's keys (None on a trusted network): bulk lanes derive theirs from them
        self.keys: SessionKeys | None = conn.keys if isinstance(conn, SecureConnection) else None
        self._on_sent = on_sent
        self.remote = remote
        self.inbound = inbound
        self._registry = registry
        self._limits = limits
        self._handlers = handlers
        self._on_close = on_close
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._sending = 0  # one-way sends (and replies) under way on this link
        self._sends_through = asyncio.Event()  # set while none is
        self._sends_through.set()
        self.last_used = asyncio.get_running_loop().time()
        self._reader = asyncio.get_running_loop().create_task(
            self._read_loop(), name=f"link-{remote.peer_id[:8]}"
        )

    @property
    def peer_id(self) -> str:
        return self.remote.peer_id

    @property
    def busy(self) -> bool:
        return bool(self._pending) or bool(self._tasks)

    @property
    def closed(self) -> bool:
        return self._closing or self.conn.closed

    async def send(self, frame: Frame) -> None:
        """Send a one-way message (or a reply). The payload goes out without being copied
        into the header's buffer. Raises FrameTooLarge, before sending anything, for a frame
        the other side would refuse."""
        payload = memoryview(frame.payload).cast("B")
        if payload.nbytes > self._limits.max_payload_bytes:
            raise FrameTooLarge(
                f"{frame.type}: payload over the limit of {self._limits.max_payload_bytes} bytes"
            )
        header = encode_header(frame)
        if len(header) - 4 > self._limits.max_header_bytes:
            raise FrameTooLarge(
                f"{frame.type}: header over the limit of {self._limits.max_header_bytes} bytes"
            )
        self.last_used = asyncio.get_running_loop().time()
        self._sending += 1
        self._sends_through.clear()
        try:
            await self.conn.send([header, payload] if payload.nbytes else header)
        finally:
            self._sending -= 1
            if not self._sending:
                self._sends_through.set()
        if self._on_sent is not None:
            self._on_sent(len(header) + payload.nbytes)

    async def request(self, frame: Frame, timeout: float | None) -> Frame:
        """Send ``frame`` as a request and wait for the reply frame.

        Raises RemoteError if the remote answered with an error, TimeoutError after
        ``timeout`` seconds, ConnectionClosed if the link closed first."""
        if self.closed:
            raise ConnectionClosed(f"link to {self.peer_id} is closed")
        request_id = next(self._ids)
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self.send(Frame(frame.type, frame.fields, frame.payload, request_id=request_id))
            async with asyncio.timeout(timeout):
                return await future
        finally:
            self._pending.pop(request_id, None)
            if future.done() and not future.cancelled():
                # a link lost during the send fails the reply too; the send's error is the
                # one raised, so the reply's is read here
                future.exception()

    async def _read_loop(self) -> None:
        reason, error = "closed by remote", False
        try:
            while True:
                data = await self.conn.recv()
                frame = decode_frame(data, self._registry, self._limits)
                self.last_used = asyncio.get_running_loop().time()
                if frame.reply_to:
                    future = self._pending.get(frame.reply_to)
                    if future is not None and not future.done():
                        if frame.type == ERROR:
                            future.set_exception(RemoteError(frame.fields["message"]))
                        else:
                            future.set_result(frame)
                    continue
                handler = self._handlers.get(frame.type)
                if handler is None:
                    raise ProtocolError(
                        f"message type {frame.type!r} is not accepted after the handshake"
                    )
                if frame.request_id:
                    task = asyncio.get_running_loop().create_task(self._serve(handler, frame))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    await handler(self, frame)
        except ConnectionClosed as exc:
            reason, error = str(exc), not exc.clean
        except ProtocolError as exc:
            reason, error = f"protocol error: {exc}", True
            logger.warning("closing link to %s: %s", self.peer_id, exc)
            with contextlib.suppress(SwarmgradError):
                await self.conn.close(str(exc), protocol_error=True)
        except asyncio.CancelledError:
            reason = "closed locally"
            raise
        finally:
            self._finish(reason, error)

    async def _serve(self, handler: Handler, frame: Frame) -> None:
        try:
            reply = await handler(self, frame)
        except (ValueError, RemoteError) as exc:
            reply = Frame(ERROR, {"message": str(exc)[:4000] or type(exc).__name__})
        except (ConnectionClosed, NodeShutdown, asyncio.CancelledError):
            return
        except Exception as exc:
            logger.exception("handler for %s failed", frame.type)
            reply = Frame(
                ERROR, {"message": f"internal error handling {frame.type}: {type(exc).__name__}"}
            )
        if reply is None:
            return
        with contextlib.suppress(ConnectionClosed, TransportError):
            await self.send(
                Frame(reply.type, reply.fields, reply.payload, reply_to=frame.request_id)
            )

    def _finish(self, reason: str, error: bool) -> None:
        was_closing = self._closing
        self._closing = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(
                    ConnectionClosed(f"link to {self.peer_id} closed: {reason}", clean=not error)
                )
        self._pending.clear()
        for task in list(self._tasks):
            task.cancel()
        self._on_close(self, reason, error and not was_closing)

    async def drained(self) -> None:
        """Return once no request of this side waits for its reply on this link and none of
        the other side's is being served here."""
        while self._pending or self._tasks:
            await asyncio.wait([*self._pending.values(), *self._tasks])

    @property
    def sending(self) -> bool:
        """A send of this side is under way on this link (a large frame on a slow link
        takes a while; the other side cannot tell, it sees only complete frames)."""
        return self._sending > 0

    async def sends_through(self) -> None:
        """Return once no send of this side is under way on this link (each send is
        bounded by its caller's timeout)."""
        while self._sending:
            await self._sends_through.wait()

    async def wait_closed(self, timeout: float | None) -> None:
        """Wait until the other side closes this link, or ``timeout`` seconds; what arrives
        meanwhile is read and served as always."""
        await asyncio.wait([self._reader], timeout=timeout)

    async def close(self, reason: str = "") -> None:
        self._closing = True
        with contextlib.suppress(SwarmgradError):
            await self.conn.close(reason)
        if not self._reader.done():
            self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
