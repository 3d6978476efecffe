"""The asynchronous node: listener, authenticated links, the store and membership.

It owns its links (:class:`peer.node.pool.LinkPool`), its gossip
(:class:`peer.node.exchange.Gossip`) and its certificates and bans
(:class:`peer.node.trust.Trust`), each handed what it needs of the node. Runs entirely on
one asyncio event loop. :class:`peer.Node` wraps it with a synchronous
API and a background thread; the many-peer simulator runs hundreds of these on one loop
over the in-memory transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from peer.exceptions import (
    ConnectionClosed,
    NodeShutdown,
)
from peer.formats.identity import (
    Authenticator,
    Identity,
    OpenAuth,
)
from peer.formats.open_types import UserMetadata
from peer.node.certificates import sendable
from peer.node.config import NodeConfig
from peer.node.cost import membership_ttl
from peer.node.exchange import GOSSIP_PUSH, Gossip
from peer.node.gossip import (
    MEMBERS_KEY,
    RESERVED_PREFIX,
    GossipStore,
    Record,
    RecordError,
    Subkey,
    ValueWithExpiration,
    next_sequence,
)
from peer.node.links import Handler, PeerLink, register_link_messages
from peer.node.membership import (
    Member,
    announced_addresses,
    decode_member,
    live_members,
    member_record,
)
from peer.node.pool import IDLE_CLOSE, LINK_RETIRE, LinkPool
from peer.node.punching import Puncher
from peer.node.reconnect import Reconnector
from peer.node.trust import Trust
from peer.transport.base import Listener, Transport
from peer.transport.bulk import BULK_TICKET, BulkLanes, BulkSender
from peer.transport.punch import PunchPort
from peer.wire import (
    Frame,
    MessageRegistry,
    Schema,
)

logger = logging.getLogger("peer.node")

T = TypeVar("T")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def check_open_mode(auth: Authenticator | None, config: NodeConfig) -> None:
    """Refuse (``ValueError``) a node that would listen beyond loopback with no
    authentication unless ``auth=OpenAuth()`` asked for it: anyone who can reach such a
    node could join its swarm."""
    if auth is None and not config.client_mode and not is_loopback(config.host):
        raise ValueError(
            f"this node would listen on {config.host} with no authentication: anyone who can "
            "reach it could join the swarm. Pass auth=SwarmKeyAuth(key) or "
            "CertificateAuth(...), or auth=OpenAuth() to run an open swarm on purpose"
        )


__all__ = ["AsyncNode", "Member", "NodeConfig", "check_open_mode", "is_loopback"]


class AsyncNode:
    """One peer's network presence. ``await start()``, then ``store``/``get``; ``await
    shutdown()`` stops every task and closes every connection."""

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        *,
        transport: Transport,
        identity: Identity | None = None,
        auth: Authenticator | None = None,
        config: NodeConfig | None = None,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
    ) -> None:
        self.config = config or NodeConfig()
        check_open_mode(auth, self.config)  # whatever builds the node, Node or not
        self.identity = identity or Identity()
        self.transport = transport
        self.clock = clock
        self.registry = MessageRegistry()
        register_link_messages(self.registry)
        self._store = GossipStore(
            max_ttl=self.config.max_record_ttl, max_bytes=self.config.max_store_bytes
        )
        self._seq = 0  # sequence number of this node's latest record (next_sequence)
        self.random = random.Random(seed)
        self.handlers: dict[str, Handler] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._member_cache: dict[bytes, Member] = {}
        self._watchers: dict[str, list[Callable[[], None]]] = {}  # key → callbacks (watch)
        self._reconnect = Reconnector(
            interval=self.config.reconnect_interval or self.config.member_ttl,
            give_up_after=self.config.reconnect_give_up,
            rng=random.Random(seed),
        )
        self._listener: Listener | None = None
        self._addresses: list[str] = []
        self.bulk: BulkLanes | None = None
        self.puncher: Puncher | None = None  # links through NATs (start_punching)
        self.bytes_sent = 0  # frame headers and payloads this node sent, links and lanes
        # accepted on lanes (also when set before start()), with their inline handlers
        self._bulk_types: dict[str, Callable[[str, Frame], None] | None] = {}
        self._started = False
        self._stopping = False
        self._next_refresh = 0.0  # clock time of the next membership refresh
        self.trust = Trust(
            auth=auth if auth is not None else OpenAuth(),
            identity=self.identity,
            store=self.store_,
            now=self.now,
            spawn=self._spawn,
            links=lambda: self.pool.all,
            running=lambda: self._started and not self._stopping,
            register=self.register_handler,
        )
        self.pool = LinkPool(
            config=self.config,
            identity=self.identity,
            transport=self.transport,
            registry=self.registry,
            handlers=self.handlers,
            trust=self.trust,
            reconnect=self._reconnect,
            addresses=lambda: self._addresses,
            members=self.members,
            stopping=lambda: self._stopping,
            spawn=self._spawn,
            on_sent=self.count_sent,
        )
        self.register_handler(LINK_RETIRE, Schema(), self.pool.on_retire)
        self.gossip = Gossip(
            config=self.config,
            peer_id=self.peer_id,
            store=self.store_,
            trust=self.trust,
            registry=self.registry,
            register=self.register_handler,
            rng=self.random,
            reconnect=self._reconnect,
            watchers=self._watchers,
            links=self.pool.by_peer,
            failed_at=self.pool.failed_at,
            now=self.now,
            members=self.members,
            link=self.link,
            connect=self.pool.connect,
            peer_failed=self.pool.peer_failed,
            spawn=self._spawn,
            initial_peers=initial_peers,
        )

    # the parts' state, as the node always showed it ----------------------------------------

    @property
    def store_(self) -> GossipStore:
        """The gossip store this node and its parts read and write."""
        return self._store

    @store_.setter
    def store_(self, store: GossipStore) -> None:
        # replaced before start (a test's or a simulator's own store): every part sees it
        self._store = self.gossip.store_ = self.trust.store_ = store

    def set_auth(self, auth: Authenticator) -> None:
        """Present ``auth`` in every later handshake (see :meth:`Trust.set_auth`)."""
        self.trust.set_auth(auth)

    def revoke(self, data: bytes) -> bool:
        """Apply the run's revocation list ``data`` (see :meth:`Trust.revoke`)."""
        return self.trust.revoke(data)

    def certified_role(self, peer_id: str) -> str | None:
        """The role the run's authority gave ``peer_id`` (see :meth:`Trust.certified_role`)."""
        return self.trust.certified_role(peer_id)

    def certified_volunteer(self, peer_id: str) -> str | None:
        """The volunteer ``peer_id``'s certificate names (:meth:`Trust.certified_volunteer`)."""
        return self.trust.certified_volunteer(peer_id)

    def certified_invite(self, peer_id: str) -> str | None:
        """The invite ``peer_id``'s certificate names (:meth:`Trust.certified_invite`)."""
        return self.trust.certified_invite(peer_id)

    async def bootstrap(self) -> None:
        """Exchange with every initial peer once, right away, so membership is known before
        the first regular round."""
        await self.gossip.bootstrap()

    # lifecycle -----------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def visible_addresses(self) -> list[str]:
        return list(self._addresses)

    async def start(self, *, bootstrap: bool = True) -> None:
        """Listen (unless in client mode), publish membership, start gossiping and, unless
        ``bootstrap=False``, exchange with the initial peers right away."""
        if self._started:
            return
        self._started = True
        self.trust.learn_own_certificate()
        try:
            await self._listen()
        except BaseException:
            # nothing half-open is left behind (a taken port, say)
            if self._listener is not None:
                await self._listener.close()
            if self.bulk is not None:
                await self.bulk.close()
            self._stopping = True
            raise
        self._publish_membership()
        # the first refresh at a random point of the first interval
        self._next_refresh = self.now() + self._refresh_interval() * self.random.random()
        self._spawn(self.gossip.loop(), "gossip")
        self._spawn(self._maintenance_loop(), "maintenance")
        if bootstrap and self.gossip.initial_peers:
            await self.bootstrap()

    async def _listen(self) -> None:
        cfg = self.config
        if not cfg.client_mode:
            self._listener = await self.transport.listen(cfg.host, cfg.port, self.pool.on_inbound)
            self._addresses = list(cfg.announce_addresses or self._listener.addresses)
        if cfg.bulk_lanes and self.transport.supports_bulk_lanes:
            self.bulk = BulkLanes(
                self,
                self.registry,
                cfg.limits,
                host=None if cfg.client_mode else cfg.host,
                port=cfg.bulk_port,
                deliver=self._deliver_bulk,
                request_timeout=cfg.request_timeout,
            )
            self.handlers[BULK_TICKET] = self.bulk.on_ticket
            for message_type, inline in self._bulk_types.items():
                self.bulk.accept(message_type, inline)
            await self.bulk.start()

    async def shutdown(self) -> None:
        """Tell connected peers this node is leaving, then stop every task, close every link
        and the listener. Idempotent."""
        if self._stopping:
            return
        if self._started:
            await self._announce_leaving()
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            await self._listener.close()
        if self.bulk is not None:
            await self.bulk.close()
        if self.puncher is not None:
            await self.puncher.close()
        await self.pool.close()

    def start_punching(self, port: PunchPort) -> Puncher:
        """Punch links through NATs from ``port`` toward the peers the coordinator
        introduces (:class:`~peer.node.punching.Puncher`); the pool dials ``punch://``
        addresses through it. Needs the WebSocket transport (relays may wrap it)."""
        from peer.transport.websocket import WebSocketTransport

        websocket = getattr(self.transport, "inner", self.transport)
        if not isinstance(websocket, WebSocketTransport):
            raise ValueError("punching through NATs needs the WebSocket transport")
        if self.puncher is not None:
            raise ValueError("this node punches already")
        self.puncher = Puncher(
            self.pool, websocket, port, own_id=self.peer_id, on_link=self.gossip.exchange
        )
        self.pool.punch = self.puncher.connect
        self._spawn(self.puncher.run(), "punch")
        return self.puncher

    def _spawn(self, coro: Coroutine[object, object, T], name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.peer_id[:8]}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_running(self) -> None:
        if self._stopping:
            raise NodeShutdown("node is shut down")

    # the store -----------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock()

    async def store(
        self, key: str, value: object, expiration_time: float, subkey: Subkey = None
    ) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time`` (wall
        clock, seconds). Returns False if this node already holds a record of its own in
        that slot with a later or equal expiration, or if the time is already past. Every
        record carries a sequence number larger than this node's previous ones, so peers
        keep the newest store of a slot whatever copies relays send them later."""
        self._check_running()
        if not isinstance(key, str) or not key:
            raise TypeError("key must be a non-empty string")
        if key.startswith(RESERVED_PREFIX):
            raise ValueError(
                f"keys starting with {RESERVED_PREFIX!r} are reserved for the node itself"
            )
        if subkey is not None and (
            isinstance(subkey, bool) or not isinstance(subkey, str | int | bytes)
        ):
            raise TypeError("subkey must be a string, an integer, bytes or None")
        now = self.now()
        record = Record.create(
            self.identity, key, subkey, value, expiration_time, seq=self._next_seq()
        )
        held = self.store_.current(record, now)
        if held is not None and held.expiration >= record.expiration:
            return False  # newest expiration wins for a store, as a reader would expect
        stored = self.store_.put(record, now)
        if not stored and self.store_.over_quota(record):
            logger.warning(
                "not stored %r: this node's records would exceed the per-peer quota of the "
                "gossip store (%d records, %d bytes), which every peer enforces",
                key,
                self.store_.max_records_per_owner,
                self.store_.max_bytes_per_owner,
            )
        elif not stored and self.store_.over_share(record):
            logger.warning(
                "not stored %r: the gossip store is full (%d bytes) and this node's records "
                "would exceed its share of it (%d bytes)",
                key,
                self.store_.max_bytes,
                self.store_.share(record.owner),
            )
        if stored:
            # Push right away to a few peers so a store is visible in about one round trip.
            self._spawn(self.gossip.push_now([record], self.config.push_relays), "push")
        return stored

    def watch(self, key: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` on the node's loop whenever a record under ``key`` arrives
        from a peer and is newer than what the store held (a peer stored or refreshed a
        value there): a reader can then ``get`` at once instead of polling. Must not block;
        what it raises is logged. Returns a function that stops the watch."""
        self._watchers.setdefault(key, []).append(callback)

        def stop() -> None:
            callbacks = self._watchers.get(key)
            if callbacks is not None and callback in callbacks:
                callbacks.remove(callback)
                if not callbacks:
                    del self._watchers[key]

        return stop

    async def get(self, key: str, latest: bool = False) -> ValueWithExpiration[UserMetadata] | None:
        """The freshest value this node knows for ``key``. With ``latest=True``, first pull
        from up to ``fanout`` peers so that a store made elsewhere a moment ago is seen."""
        self._check_running()
        if latest:
            await self.gossip.round(full=True)
        return self.store_.get(key, self.now())

    def members(self) -> dict[str, Member]:
        """Peers whose membership record is live, this node included."""
        records = self.store_.records(MEMBERS_KEY, self.now())
        members, self._member_cache = live_members(records, self._member_cache)
        return members

    def _next_seq(self) -> int:
        self._seq = next_sequence(self._seq, self.now())
        return self._seq

    def _publish_membership(self) -> Record:
        now = self.now()
        # later than our own record in the store, even within one tick of the clock
        latest = max(
            (
                r.expiration
                for r in self.store_.records(MEMBERS_KEY, now)
                if r.owner_id == self.peer_id
            ),
            default=now,
        )
        ttl = membership_ttl(self.config.member_ttl, self.gossip.swarm_size, self.store_.max_ttl)
        expiration = max(now + ttl, latest + 1e-3)
        record = member_record(
            self.identity, self._addresses, self.config.client_mode, expiration, self._next_seq()
        )
        self.store_.put(record, now)
        return record

    def announce(self, addresses: Sequence[str]) -> None:
        """Tell the swarm to dial this node at ``addresses`` from now on (e.g. the address
        the coordinator reached it at, when the node listens behind NAT): republishes its
        membership record, pushes it to peers at once, and presents the addresses in later
        handshakes. Not in client mode (``ValueError``): nobody can dial such a node."""
        self._check_running()
        announced = announced_addresses(addresses, self.config.client_mode)
        self._addresses = announced
        record = self._publish_membership()
        self._spawn(self.gossip.push_now([record], self.config.push_relays), "push")

    async def add_initial_peers(self, addresses: Sequence[str]) -> int:
        """Dial ``addresses`` now and keep them as initial peers: each is retried until
        reached once, and all of them whenever this node is alone (for a node that lost
        every peer, with fresh addresses from the coordinator), each until it did not answer
        ``bootstrap_attempts`` times in a row. They replace those added by an earlier call;
        the constructor's stay. Returns how many answered."""
        self._check_running()
        if isinstance(addresses, str):
            raise TypeError('addresses is a list, e.g. ["ws://203.0.113.7:4000"]')
        return await self.gossip.add_initial_peers(addresses)

    @property
    def num_links(self) -> int:
        """Peers this node has an open link to right now."""
        return self.pool.num_open

    async def _announce_leaving(self) -> None:
        """Replace our membership record with a newer one marked ``leaving`` and push it over
        the open links, so peers stop dialing us at once instead of timing out."""
        now = self.now()
        own = [
            r for r in self.store_.records(MEMBERS_KEY, now) if r.owner == self.identity.public_key
        ]
        expiration = max((r.expiration for r in own), default=now) + 1e-3
        record = member_record(
            self.identity, [], self.config.client_mode, expiration, self._next_seq(), leaving=True
        )
        self.store_.put(record, now)
        frame = Frame(
            GOSSIP_PUSH,
            self.gossip.records_fields(sendable([record], self.trust.certificates, now), now),
        )
        links = self.pool.open_links()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(1.0, self.config.request_timeout)):
                await asyncio.gather(*(link.send(frame) for link in links), return_exceptions=True)

    # handlers and links --------------------------------------------------------------------

    def register_handler(self, message_type: str, schema: Schema, handler: Handler) -> None:
        """Accept ``message_type`` (validated by ``schema``) from authenticated peers."""
        self.registry.register(message_type, schema)
        self.handlers[message_type] = handler

    async def request(self, peer_id: str, frame: Frame, timeout: float | None = None) -> Frame:
        """Send ``frame`` to ``peer_id`` as a request and return its reply, within
        ``timeout`` (default: the node's ``request_timeout``).

        A link the other side closes as idle (:data:`IDLE_CLOSE`) just as the request
        crosses its close was never read there (a peer closes as idle only links with no
        request in hand): the request goes once more, over a new link."""
        loop = asyncio.get_running_loop()
        timeout = self.config.request_timeout if timeout is None else timeout
        deadline = None if timeout is None else loop.time() + timeout
        link = await self.link(peer_id)
        try:
            return await link.request(frame, timeout)
        except ConnectionClosed:
            if link.conn.close_reason != IDLE_CLOSE:
                raise
        left = None if deadline is None else max(0.0, deadline - loop.time())
        link = await self.link(peer_id)
        return await link.request(frame, left)

    async def send(self, peer_id: str, frame: Frame) -> None:
        link = await self.link(peer_id)
        await link.send(frame)

    def accept_bulk(
        self, message_type: str, inline: Callable[[str, Frame], None] | None = None
    ) -> None:
        """Let one-way frames of ``message_type`` (registered with a handler) arrive over
        bulk lanes too. May be called before :meth:`start`.

        ``inline(peer_id, frame)``, if given, handles the frames that arrive on lanes, called
        straight from the lane's reader (no task per frame): a plain function that must not
        block or await; what it raises is logged and the frame dropped. Frames of the type
        that arrive over a link still go to the registered handler."""
        if inline is not None:
            handler = inline

            def guarded(peer_id: str, frame: Frame) -> None:
                if not self._stopping:
                    handler(peer_id, frame)

            inline = guarded

        self._bulk_types[message_type] = inline
        if self.bulk is not None:
            self.bulk.accept(message_type, inline)

    async def send_bulk(self, peer_id: str, frame: Frame) -> None:
        """Send a large one-way frame: over a bulk lane when the transport has them (no
        copies in user space), else over the link. Same delivery as :meth:`send`; frames
        sent this way may overtake frames sent with :meth:`send`."""
        self._check_running()
        if self.bulk is None:
            await self.send(peer_id, frame)
        else:
            await self.bulk.send(peer_id, frame)

    async def _deliver_bulk(self, sender: BulkSender, frame: Frame) -> None:
        handler = self.handlers.get(frame.type)
        if handler is not None and not self._stopping:
            await handler(sender, frame)  # type: ignore[arg-type]  # a link's peer_id only

    async def link(self, peer_id: str, addresses: Sequence[str] | None = None) -> PeerLink:
        """An authenticated link to ``peer_id``, reusing an open one or dialing its known
        addresses. Raises TransportError when it cannot be reached."""
        return await self.pool.link(peer_id, addresses)

    def count_sent(self, nbytes: int) -> None:
        self.bytes_sent += nbytes

    def _refresh_interval(self) -> float:
        """Seconds until this node republishes its membership record: a third of its time
        to live (:func:`~peer.node.cost.membership_ttl`), less up to a quarter at random
        so that peers that started together do not refresh together."""
        ttl = membership_ttl(self.config.member_ttl, self.gossip.swarm_size, self.store_.max_ttl)
        return max(self.config.gossip_period, ttl / 3 * self.random.uniform(0.75, 1.0))

    async def _maintenance_loop(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.gossip_period)
            now = self.now()
            if now >= self._next_refresh:
                self._publish_membership()
                self._next_refresh = now + self._refresh_interval()
            self.trust.close_expired_links()
            self.trust.forget_expired_certificates(now)
            for record in self.store_.expire(now):
                if record.key == MEMBERS_KEY and record.owner_id != self.peer_id:
                    peer_id = record.owner_id
                    self.pool.forget(peer_id)
                    logger.info("peer %s left the swarm (membership expired)", peer_id)
                    with contextlib.suppress(RecordError):
                        self._reconnect.departed(peer_id, decode_member(record)[0], now)
