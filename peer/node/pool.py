"""A node's authenticated links to its peers: dialing (one dial per peer at a time),
accepting (with bounds on the connections still in their handshake, in all and per source),
keeping at most ``max_links`` by retiring idle ones without losing what crosses them, and
remembering which peers failed and when. Owned by :class:`~peer.node.core.AsyncNode`, which
hands it what it needs of the node; nothing here imports the node."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence

from peer.exceptions import (
    AuthenticationError,
    ConnectionClosed,
    NodeShutdown,
    ProtocolError,
    SwarmgradError,
    TransportError,
)
from peer.formats.identity import Identity, peer_id_from_public_key
from peer.node.config import NodeConfig
from peer.node.links import Handler, PeerLink, RemotePeer, handshake
from peer.node.membership import Member
from peer.node.reconnect import Reconnector
from peer.node.trust import LINK_REVOCATIONS, Trust, send_quietly
from peer.transport.base import Connection, Transport, source_of
from peer.transport.punch import is_punch_address
from peer.wire import Frame, MessageRegistry

logger = logging.getLogger("peer.node")

#: the reason a node gives when it closes a link it has not used for a while
IDLE_CLOSE = "idle"
#: one-way, over a link: "I send nothing more on this link; close it once your requests on
#: it are answered" (what a node says of the idle links it closes beyond ``max_links``)
LINK_RETIRE = "link.retire"
#: how long either side of a retired link waits for the other's sends under way on it (a
#: send is bounded by its caller's timeout; this only bounds a peer that never closes)
RETIRE_WAIT = 120.0


class LinkPool:
    """The links of one node, by peer id (``by_peer``: the one each peer is reached by) and
    all of them (``all``: also those on their way out). ``failed_at`` holds when each peer
    last failed (loop time), until it is reached again or leaves the swarm."""

    def __init__(
        self,
        *,
        config: NodeConfig,
        identity: Identity,
        transport: Transport,
        registry: MessageRegistry,
        handlers: dict[str, Handler],
        trust: Trust,
        reconnect: Reconnector,
        addresses: Callable[[], list[str]],
        members: Callable[[], dict[str, Member]],
        stopping: Callable[[], bool],
        spawn: Callable[[Coroutine[object, object, object], str], object],
        on_sent: Callable[[int], None],
    ) -> None:
        self.config = config
        self.identity = identity
        self.transport = transport
        self.registry = registry
        self.handlers = handlers
        self.trust = trust
        self.reconnect = reconnect
        self.addresses = addresses
        self.members = members
        self.stopping = stopping
        self.spawn = spawn
        self.on_sent = on_sent
        #: dials a ``punch://`` address (:meth:`peer.node.punching.Puncher.connect`); None
        #: for a node that does not punch
        self.punch: Callable[[str, str | None], Awaitable[PeerLink]] | None = None
        self.by_peer: dict[str, PeerLink] = {}
        self.all: set[PeerLink] = set()
        self.failed_at: dict[str, float] = {}
        self._dialing: dict[str, asyncio.Future[PeerLink]] = {}
        self._retired: set[PeerLink] = set()  # retired by the other side, closing
        self._lost_warned: set[str] = set()
        self._handshaking = 0  # inbound connections in their handshake
        self._handshaking_from: dict[str, int] = {}  # ... by source (source_of)
        self._sources_warned: set[str] = set()  # sources told off for their handshakes
        self._handshakes_full = False  # warned that they reached max_pending_handshakes

    @property
    def num_open(self) -> int:
        """Peers with an open link right now."""
        return sum(not link.closed for link in self.by_peer.values())

    def open_links(self) -> list[PeerLink]:
        return [link for link in self.by_peer.values() if not link.closed]

    @property
    def dialing(self) -> frozenset[str]:
        """The peers a dial is under way to."""
        return frozenset(self._dialing)

    def open_links_to(self, peer_id: str) -> list[PeerLink]:
        """Every open link to ``peer_id``, the one in use and any on their way out."""
        return [link for link in self.all if link.peer_id == peer_id and not link.closed]

    # reaching a peer -------------------------------------------------------------------------

    async def link(self, peer_id: str, addresses: Sequence[str] | None = None) -> PeerLink:
        """An authenticated link to ``peer_id``, reusing an open one or dialing its known
        addresses. Raises TransportError when it cannot be reached."""
        if self.stopping():
            raise NodeShutdown("node is shut down")
        link = self.by_peer.get(peer_id)
        if link is not None and not link.closed:
            return link
        pending = self._dialing.get(peer_id)
        if pending is None:
            if addresses is None:
                member = self.members().get(peer_id)
                addresses = member.addresses if member else ()
            if not addresses:
                raise TransportError(
                    f"peer {peer_id} is not reachable: no open link and no address"
                )
            pending = asyncio.get_running_loop().create_future()
            self._dialing[peer_id] = pending
            self.spawn(self._dial(peer_id, list(addresses), pending), "dial")
        return await asyncio.shield(pending)

    async def _dial(
        self, peer_id: str | None, addresses: list[str], result: asyncio.Future[PeerLink]
    ) -> None:
        errors = []
        try:
            for address in addresses:
                try:
                    link = await self.connect(address, peer_id)
                except (TransportError, ProtocolError, AuthenticationError) as exc:
                    errors.append(f"{address}: {exc}")
                    continue
                in_use = self.by_peer.get(link.peer_id)
                if in_use is not None and not in_use.closed:
                    link = in_use  # a direct link came meanwhile (see _adopt)
                if not result.done():
                    result.set_result(link)
                return
            if not result.done():
                result.set_exception(
                    TransportError(f"cannot reach {peer_id or addresses}: {'; '.join(errors)}")
                )
                result.exception()  # mark retrieved: callers may have given up
        except asyncio.CancelledError:
            if not result.done():
                result.set_exception(NodeShutdown("node is shutting down"))
                result.exception()
            raise
        finally:
            if peer_id is not None and self._dialing.get(peer_id) is result:
                del self._dialing[peer_id]

    async def connect(self, address: str, expected_peer_id: str | None) -> PeerLink:
        """Dial ``address`` and shake hands (with ``expected_peer_id`` if known): a new link.
        A ``punch://`` address goes to :attr:`punch` (a node that punches through NATs)."""
        if is_punch_address(address):
            if self.punch is None:
                raise TransportError(f"{address}: this node does not punch through NATs")
            return await self.punch(address, expected_peer_id)
        conn = await self.transport.connect(address, timeout=self.config.request_timeout)
        return await self.adopt(conn, expected_peer_id, inbound=False)

    async def adopt(
        self, conn: Connection, expected_peer_id: str | None, *, inbound: bool
    ) -> PeerLink:
        """Shake hands over ``conn``, a connection this node opened or chose to take (a
        punched one), and keep the link; the connection is closed if the handshake fails."""
        try:
            remote, conn = await self._handshake(conn, expected_peer_id)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close("handshake failed")
            raise
        return self._adopt(conn, remote, inbound=inbound)

    async def serve(self, link: PeerLink) -> None:
        """Wait until ``link`` closes (what a handler serving an adopted link returns on)."""
        with contextlib.suppress(asyncio.CancelledError):
            await link._reader

    async def _handshake(
        self, conn: Connection, expected_peer_id: str | None
    ) -> tuple[RemotePeer, Connection]:
        cfg = self.config
        return await handshake(
            conn,
            identity=self.identity,
            auth=self.trust.auth,
            addresses=self.addresses(),
            client_mode=cfg.client_mode,
            registry=self.registry,
            limits=cfg.limits,
            timeout=cfg.request_timeout,
            expected_peer_id=expected_peer_id,
            encrypt=cfg.encryption,
            refuse_key=self._refusal,
        )

    def _refusal(self, public_key: bytes) -> str | None:
        """Why a handshake refuses ``public_key`` at its hello (before its frame limit
        could rise): a peer the run's authority banned."""
        if self.trust.banned(public_key):
            return f"peer {peer_id_from_public_key(public_key)} is banned by the run's authority"
        return None

    # being reached ---------------------------------------------------------------------------

    async def on_inbound(self, conn: Connection) -> None:
        """The listener's handler: shake hands within the bounds, then serve the link until
        it closes (the transport closes the connection when this returns)."""
        if self.stopping():
            return
        if self._handshaking >= self.config.max_pending_handshakes:
            if not self._handshakes_full:
                self._handshakes_full = True
                logger.warning(
                    "%d connections are in their handshake: refusing more (from %s first)",
                    self._handshaking,
                    conn.remote_address,
                )
            with contextlib.suppress(Exception):
                await conn.close("busy: too many connections in their handshake")
            return
        source = source_of(conn.remote_address)
        pending = self._handshaking_from.get(source, 0)
        if pending >= self.config.max_pending_handshakes_per_source:
            if source not in self._sources_warned:
                if len(self._sources_warned) >= 1024:
                    self._sources_warned.clear()  # bounded, whatever the sources
                self._sources_warned.add(source)
                logger.warning(
                    "%s has %d connections in their handshake: refusing more from it",
                    source,
                    pending,
                )
            with contextlib.suppress(Exception):
                await conn.close("busy: too many connections from your address in their handshake")
            return
        self._handshaking += 1
        self._handshaking_from[source] = pending + 1
        try:
            remote, conn = await self._handshake(conn, None)
        except (AuthenticationError, ProtocolError) as exc:
            logger.warning("refused connection from %s: %s", conn.remote_address, exc)
            with contextlib.suppress(Exception):
                await conn.close(str(exc), protocol_error=True)
            return
        except (ConnectionClosed, TransportError) as exc:
            logger.info("connection from %s ended in its handshake: %s", conn.remote_address, exc)
            return
        finally:
            self._handshaking -= 1
            left = self._handshaking_from[source] - 1
            if left:
                self._handshaking_from[source] = left
            else:
                del self._handshaking_from[source]
            if self._handshaking < self.config.max_pending_handshakes // 2:
                self._handshakes_full = False
        link = self._adopt(conn, remote, inbound=True)
        with contextlib.suppress(asyncio.CancelledError):
            await link._reader

    def _adopt(self, conn: Connection, remote: RemotePeer, *, inbound: bool) -> PeerLink:
        link = PeerLink(
            conn,
            remote,
            registry=self.registry,
            limits=self.config.limits,
            handlers=self.handlers,
            on_close=self._on_link_closed,
            inbound=inbound,
            on_sent=self.on_sent,
        )
        self.all.add(link)
        in_use = self.by_peer.get(remote.peer_id)
        if in_use is not None and not in_use.closed and via_relay(link) and not via_relay(in_use):
            # a direct link to the peer stands: it stays in use and this one is retired (a
            # relay carries only the pairs that cannot link directly)
            self.all.discard(link)
            self.spawn(self._retire(link), "retire")
        else:
            self.by_peer[remote.peer_id] = link
        self.trust.learn_certificate(remote)
        revocations = self.trust.revocations
        if revocations is not None and revocations.current is not None:
            # a peer that was away may not know the run's latest bans yet
            frame = Frame(LINK_REVOCATIONS, {"list": revocations.current.to_bytes()})
            self.spawn(send_quietly(link, frame), "revocations")
        self.failed_at.pop(remote.peer_id, None)
        self.reconnect.returned(remote.peer_id)
        if remote.peer_id in self._lost_warned:
            self._lost_warned.discard(remote.peer_id)
            logger.info("reconnected to peer %s", remote.peer_id)
        self.evict_idle()
        return link

    # losing a peer ---------------------------------------------------------------------------

    def _on_link_closed(self, link: PeerLink, reason: str, unexpected: bool) -> None:
        self.all.discard(link)
        if self.by_peer.get(link.peer_id) is link:
            del self.by_peer[link.peer_id]
        if unexpected and not self.stopping():
            self.peer_failed(link.peer_id, reason)

    def peer_failed(self, peer_id: str, reason: str) -> None:
        """``peer_id`` could not be reached or its link broke: note when, warn once."""
        self.failed_at[peer_id] = asyncio.get_running_loop().time()
        if peer_id not in self._lost_warned:
            self._lost_warned.add(peer_id)
            logger.warning("lost contact with peer %s: %s", peer_id, reason)
        else:
            logger.debug("peer %s still unreachable: %s", peer_id, reason)

    def forget(self, peer_id: str) -> None:
        """``peer_id`` left the swarm: its failures no longer count."""
        self.failed_at.pop(peer_id, None)
        self._lost_warned.discard(peer_id)

    # keeping the pool small ------------------------------------------------------------------

    def evict_idle(self) -> None:
        """Retire the least recently used idle links beyond ``max_links``."""
        excess = len(self.all) - self.config.max_links
        if excess <= 0:
            return
        # Only links silent for a while: one carrying a stream of one-way messages (tensor
        # parts) has no pending request, yet closing it would break the stream.
        cutoff = asyncio.get_running_loop().time() - self.config.link_idle_grace
        idle = sorted(
            (lk for lk in self.all if not lk.busy and lk.last_used < cutoff),
            key=lambda lk: lk.last_used,
        )
        for link in idle[:excess]:
            self.all.discard(link)
            if self.by_peer.get(link.peer_id) is link:
                del self.by_peer[link.peer_id]
            self.spawn(self._retire(link), "retire")

    def retire(self, link: PeerLink) -> None:
        """Close ``link``, which another link to its peer replaced, without losing what
        crosses it (:meth:`_retire`)."""
        if link not in self.all:
            return
        self.all.discard(link)
        if self.by_peer.get(link.peer_id) is link:
            del self.by_peer[link.peer_id]
        self.spawn(self._retire(link), "retire")

    async def _retire(self, link: PeerLink) -> None:
        """Close a link this node no longer needs without losing what is crossing it, as
        both sides agree: this side asks (the notice goes out after its own sends under
        way, whole); the other stops sending on it and closes it once its requests on it
        are answered and its own sends under way are through. Only that side can tell (a
        frame partly in is invisible here), so this side waits for its close, reading and
        serving the link meanwhile, and closes it itself only after
        :data:`RETIRE_WAIT` (a peer that never closes) or once its own sends are through."""
        try:
            with contextlib.suppress(SwarmgradError):
                await link.send(Frame(LINK_RETIRE))
            await link.wait_closed(max(RETIRE_WAIT, self.config.request_timeout))
        finally:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RETIRE_WAIT):
                    await link.sends_through()
            await link.close(IDLE_CLOSE)

    async def on_retire(self, link: PeerLink, frame: Frame) -> None:
        """The handler of :data:`LINK_RETIRE`: the other side retires ``link``. Once per
        link: a repeated notice (a flood of them) starts no second close."""
        if link in self._retired:
            return
        if self.by_peer.get(link.peer_id) is link:
            del self.by_peer[link.peer_id]  # what this node sends next goes over a new link
        self.all.discard(link)
        self._retired.add(link)
        self.spawn(self._close_retired(link), "retired")

    async def _close_retired(self, link: PeerLink) -> None:
        """Close a link the other side retires once this side's requests on it are
        answered (up to ``request_timeout``) and its sends under way on it are through (up
        to :data:`RETIRE_WAIT`): the other side waits for this close, so nothing this side
        sent is cut."""
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.request_timeout):
                    await link.drained()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RETIRE_WAIT):
                    await link.sends_through()
        finally:
            await link.close(IDLE_CLOSE)
            self._retired.discard(link)

    async def close(self) -> None:
        """Cancel the dials under way and close every link (the node is shutting down)."""
        for future in self._dialing.values():
            future.cancel()
        links = list(self.all)
        await asyncio.gather(
            *(link.close("node shutting down") for link in links), return_exceptions=True
        )
        self.by_peer.clear()
        self.all.clear()


def via_relay(link: PeerLink) -> bool:
    """Whether ``link`` goes through a relay (its connection's address is a relay's)."""
    return link.conn.remote_address.startswith("relay://")
