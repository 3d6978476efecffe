"""Links between peers behind NATs: punched at the coordinator's word, kept while it stands.

The coordinator is the rendezvous: it knows the public address each volunteer behind a NAT
comes from, and the volunteer names the port it punches from
(:class:`~peer.transport.punch.PunchPort`). It introduces such peers to each other
(:meth:`Puncher.introduce`, peer id → :class:`~peer.transport.punch.PunchEndpoint`), and
that list is the only place a punch goes: a ``punch://`` address in a member record names
which peer to reach, never where, so a peer cannot make others send toward an address of
its choosing, and the link's handshake still authenticates whoever answers.

:class:`PunchSchedule` says when to punch toward whom (no I/O); :class:`Puncher` does it for
a node, falls back to the peer's relays while a punch does not get through, and keeps links
to public peers for a node nobody can dial.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from peer.exceptions import AuthenticationError, ProtocolError, TransportError
from peer.node.pool import via_relay
from peer.transport.punch import (
    PunchEndpoint,
    PunchPort,
    dials_first,
    parse_punch_address,
    simultaneous_open,
)

if TYPE_CHECKING:
    from peer.node.links import PeerLink
    from peer.node.pool import LinkPool
    from peer.transport.base import Connection
    from peer.transport.websocket import WebSocketTransport

logger = logging.getLogger("peer.node.punching")

__all__ = ["PunchOutcome", "PunchSchedule", "Puncher"]


@dataclass(frozen=True, slots=True)
class PunchOutcome:
    """How the last attempt toward a peer ended: ``direct`` (a punched link), or not and
    why."""

    direct: bool
    detail: str
    at: float


@dataclass(slots=True)
class _Target:
    endpoint: PunchEndpoint
    next_at: float
    in_flight: bool = False
    outcome: PunchOutcome | None = None
    attempts: int = 0


@dataclass
class PunchSchedule:
    """Which introduced peers to punch toward, and when; no I/O, no clock (times are wall
    clock seconds, passed in).

    Both sides of a pair must open toward each other at about the same time. Each
    introduced peer is punched toward at once, and the attempt lasts ``window_s``; a pair that
    did not meet tries again at every multiple of ``retry_period_s`` of the wall clock, so two
    peers whose clocks differ by less than half the window meet at the next one, with no
    message between them. A link
    the pool wants to a punchable peer (:meth:`Puncher.connect`, the pool's dial of a
    ``punch://`` address) starts an attempt at once; the other side is already trying, or will
    at the next slot.

    A pair that joined about together is introduced to its two sides at different times: each
    learns of the other at its own next call to the rendezvous. So the first attempt toward a
    newly introduced peer lasts ``window_s + introduction_lag_s`` (the lag: how often the other
    side asks), long enough for the other side to learn of this one and answer."""

    window_s: float = 10.0
    retry_period_s: float = 60.0
    max_parallel: int = 8
    #: how long the other side of a newly introduced pair may take to learn of it (how
    #: often it asks the rendezvous): the first attempt toward a peer lasts this much more
    introduction_lag_s: float = 10.0
    _targets: dict[str, _Target] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (0 < self.window_s < self.retry_period_s):
            raise ValueError("window_s is positive and shorter than retry_period_s")
        if not 0 <= self.introduction_lag_s < self.retry_period_s - self.window_s:
            raise ValueError(
                "introduction_lag_s is at least 0, and a first attempt is shorter than "
                "retry_period_s"
            )
        if self.max_parallel < 1:
            raise ValueError("max_parallel is at least 1")

    def introduce(self, endpoints: Iterable[PunchEndpoint], now: float) -> None:
        """The coordinator's current list: peers no longer on it are forgotten, new ones
        are due at once, known ones keep their state (an endpoint that moved is due at
        once)."""
        fresh: dict[str, _Target] = {}
        for endpoint in endpoints:
            known = self._targets.get(endpoint.peer_id)
            if known is not None and known.endpoint == endpoint:
                fresh[endpoint.peer_id] = known
            else:
                fresh[endpoint.peer_id] = _Target(endpoint, next_at=now)
        self._targets = fresh

    def endpoint(self, peer_id: str) -> PunchEndpoint | None:
        target = self._targets.get(peer_id)
        return None if target is None else target.endpoint

    def peers(self) -> list[str]:
        return list(self._targets)

    def window(self, peer_id: str) -> float:
        """How long an attempt toward ``peer_id`` lasts: ``window_s``, and the
        introduction's lag more for the first one (the other side may not know of this
        one yet)."""
        target = self._targets.get(peer_id)
        first = target is None or target.attempts == 0
        return self.window_s + (self.introduction_lag_s if first else 0.0)

    def due(self, now: float, linked: Callable[[str], bool]) -> list[PunchEndpoint]:
        """The endpoints to punch toward now (marked in flight; report each with
        :meth:`finished`): introduced, without a link, not in flight, their time come; at
        most ``max_parallel`` in flight in all."""
        flying = sum(target.in_flight for target in self._targets.values())
        chosen = []
        for peer_id, target in sorted(self._targets.items(), key=lambda kv: kv[1].next_at):
            if flying >= self.max_parallel:
                break
            if target.in_flight or target.next_at > now or linked(peer_id):
                continue
            target.in_flight = True
            flying += 1
            chosen.append(target.endpoint)
        return chosen

    def began(self, peer_id: str) -> None:
        """An attempt toward ``peer_id`` (one :meth:`due` or :meth:`start` marked) is under
        way: the next ones are not the first."""
        target = self._targets.get(peer_id)
        if target is not None:
            target.attempts += 1

    def start(self, peer_id: str, now: float) -> str | None:
        """Mark an attempt toward ``peer_id`` begun now (one the pool asked for); or why
        not: it was not introduced, one is in flight already, or the last one missed and
        the next slot has not come (the other side tries only then: a pool that asks for
        the link meanwhile goes on to the peer's other addresses, such as a relay)."""
        target = self._targets.get(peer_id)
        if target is None:
            return "not introduced by the coordinator: no punching toward it"
        if target.in_flight:
            return "a punch toward it is under way"
        if target.next_at > now and target.outcome is not None and not target.outcome.direct:
            return f"the last punch missed ({target.outcome.detail}); next at the next slot"
        target.in_flight = True
        return None

    def finished(self, peer_id: str, *, direct: bool, detail: str, now: float) -> None:
        """An attempt ended. A link that comes later closed makes its peer due again at
        once (:meth:`lost`); a failure waits for the next slot of the wall clock."""
        target = self._targets.get(peer_id)
        if target is None:
            return
        target.in_flight = False
        target.outcome = PunchOutcome(direct, detail, now)
        target.next_at = now if direct else self.next_slot(now)

    def lost(self, peer_id: str, now: float) -> None:
        """The punched link to ``peer_id`` closed: due again at once."""
        target = self._targets.get(peer_id)
        if target is not None and not target.in_flight:
            target.next_at = now

    def next_slot(self, now: float) -> float:
        """The next multiple of ``retry_period_s`` after ``now``: when both sides of a pair
        that missed each other try again."""
        return (math.floor(now / self.retry_period_s) + 1) * self.retry_period_s

    def outcomes(self) -> dict[str, PunchOutcome]:
        return {
            peer_id: target.outcome
            for peer_id, target in self._targets.items()
            if target.outcome is not None
        }


class Puncher:
    """Punches links for a node (:class:`PunchSchedule` says when): ``pool`` adopts them,
    ``websocket`` opens the WebSocket connection over a punched socket, ``port`` is where
    this node punches from, ``on_link`` is awaited with each new punched link (the node's
    first gossip exchange over it: the two may not know each other's records yet);
    ``relay_after_s`` is how long an attempt goes without a link before the peer's relay
    addresses are dialed beside it. Start :meth:`run` as a task of the node; :meth:`close`
    with it.

    A punch may never get through (a symmetric router on one side). Where the coordinator
    names a relay for the peer, a link through it is opened once an attempt has gone
    ``relay_after_s`` without a link (as a browser that tries a second address while the first
    is still slow), so that a peer behind such a router averages within seconds of joining;
    the punch goes on, at the slots after a miss, and a punched link that comes retires the
    relayed one: the relay carries only the pairs that cannot link directly.

    Public peers cannot dial a peer behind a NAT, and do not punch toward it either: its
    router drops what they send unless it punches back, and the rendezvous introduces peers
    behind NATs to each other only. So a node that announces no address others can dial keeps
    a direct link to each public member it knows (up to ``keep_public``), dialing it again
    when the link closes (at most once per ``window_s``), and in place of a relayed link:
    whichever of the two leads a group, its followers reach it over that link. A public node
    takes the rendezvous's list too, but does not punch of itself: while it has no link at all
    (it came when every other peer was behind a NAT, so nobody's bootstrap named it), it links
    to one introduced peer through that peer's relays; gossip over that link tells the others
    its address, and they dial it."""

    def __init__(
        self,
        pool: LinkPool,
        websocket: WebSocketTransport,
        port: PunchPort,
        *,
        own_id: str,
        schedule: PunchSchedule | None = None,
        clock: Callable[[], float] = time.time,
        on_link: Callable[[PeerLink], Awaitable[None]] | None = None,
        relay_after_s: float = 3.0,
        keep_public: int = 16,
    ) -> None:
        if relay_after_s < 0:
            raise ValueError("relay_after_s is at least 0")
        if keep_public < 0:
            raise ValueError("keep_public is at least 0")
        self.relay_after_s = relay_after_s
        self.keep_public = keep_public
        self.pool = pool
        self.websocket = websocket
        self.port = port
        self.own_id = own_id
        self.schedule = schedule or PunchSchedule()
        self.clock = clock
        self.on_link = on_link
        self._flights: dict[str, asyncio.Future[PeerLink]] = {}
        self._fallbacks: dict[str, list[str]] = {}
        self._relaying: set[str] = set()
        self._keeping: dict[str, float] = {}  # public peer -> when its last dial began
        self._isolation_tried: set[str] = set()  # a public node's relay attempts, in turn
        self._tasks: set[asyncio.Task[object]] = set()
        self._wake = asyncio.Event()

    def introduce(
        self,
        endpoints: Mapping[str, PunchEndpoint] | Iterable[PunchEndpoint],
        fallbacks: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """The coordinator's list of punchable peers (this node's own entry is ignored), and
        for each, the addresses to dial when a punch toward it misses and no link is left
        (its addresses at the coordinator's relays)."""
        values = endpoints.values() if isinstance(endpoints, Mapping) else endpoints
        self.schedule.introduce((e for e in values if e.peer_id != self.own_id), self.clock())
        self._fallbacks = {
            peer: list(addresses)
            for peer, addresses in (fallbacks or {}).items()
            if self.schedule.endpoint(peer) is not None and addresses
        }
        self._wake.set()

    def outcomes(self) -> dict[str, PunchOutcome]:
        return self.schedule.outcomes()

    async def run(self) -> None:
        """Punch toward every due peer, wake once a second or when introduced."""
        while True:
            now = self.clock()
            if self._public():
                self._end_isolation()
            else:
                for endpoint in self.schedule.due(now, self._linked_directly):
                    self._launch(endpoint)
                self._keep_public_links(now)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._wake.wait()

    def _linked(self, peer_id: str) -> bool:
        link = self.pool.by_peer.get(peer_id)
        return link is not None and not link.closed

    def _public(self) -> bool:
        """Whether this node announces an address any peer may dial."""
        return any(_dialable(a) for a in self.pool.addresses())

    def _end_isolation(self) -> None:
        """A public node without a single link links to an introduced peer through its
        relays (see the module's docstring), one attempt at a time."""
        if self._relaying or self.pool.open_links():
            return
        for peer_id in sorted(self._fallbacks):
            if peer_id not in self._isolation_tried:  # each once while isolated, in turn
                self._isolation_tried.add(peer_id)
                self._relay_if_unlinked(peer_id)
                return
        self._isolation_tried.clear()  # every one tried: from the first again, a second later

    def _linked_directly(self, peer_id: str) -> bool:
        """Linked, and not through a relay: a peer linked only through one is punched
        toward again at the slots."""
        link = self.pool.by_peer.get(peer_id)
        return link is not None and not link.closed and not via_relay(link)

    async def connect(self, address: str, expected_peer_id: str | None) -> PeerLink:
        """The pool's dial of a ``punch://`` address: a link to the peer it names, punched
        toward the endpoint the coordinator gave for it (never the address's own host)."""
        try:
            named = parse_punch_address(address)
        except ValueError as exc:
            raise TransportError(str(exc)) from None
        if expected_peer_id is not None and named.peer_id != expected_peer_id:
            raise TransportError(f"{address} names another peer than {expected_peer_id}")
        flight = self._flights.get(named.peer_id)
        if flight is None:
            endpoint = self.schedule.endpoint(named.peer_id)
            refused = self.schedule.start(named.peer_id, self.clock())
            if endpoint is None or refused is not None:
                raise TransportError(f"no direct path to peer {named.peer_id}: {refused}")
            flight = self._launch(endpoint)
        if not self._fallbacks.get(named.peer_id):
            return await asyncio.shield(flight)
        # the pool goes on to the peer's relay addresses when the punch is slow; a punched
        # link that comes later replaces the relayed one
        try:
            async with asyncio.timeout(self.relay_after_s):
                return await asyncio.shield(flight)
        except TimeoutError:
            raise TransportError(
                f"no direct path to peer {named.peer_id} within {self.relay_after_s:g} s "
                "(the punch goes on)"
            ) from None

    def _launch(self, endpoint: PunchEndpoint) -> asyncio.Future[PeerLink]:
        flight: asyncio.Future[PeerLink] = asyncio.get_running_loop().create_future()
        self._flights[endpoint.peer_id] = flight
        task = asyncio.get_running_loop().create_task(self._attempt(endpoint, flight))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return flight

    async def _attempt(self, endpoint: PunchEndpoint, flight: asyncio.Future[PeerLink]) -> None:
        peer_id = endpoint.peer_id
        punching = asyncio.ensure_future(self._punch(endpoint))
        try:
            if not self._fallbacks.get(peer_id):
                link = await punching
            else:
                done, _ = await asyncio.wait({punching}, timeout=self.relay_after_s)
                if not done:
                    self._relay_if_unlinked(peer_id)
                link = await punching
        except (OSError, TransportError, TimeoutError) as exc:
            detail = str(exc) or type(exc).__name__
            self.schedule.finished(peer_id, direct=False, detail=detail, now=self.clock())
            logger.info("no direct path to peer %s yet: %s", peer_id, detail)
            if not flight.done():
                flight.set_exception(TransportError(f"cannot punch to {peer_id}: {detail}"))
                flight.exception()  # the pool may have given up waiting
            self._relay_if_unlinked(peer_id)
        except BaseException as exc:
            punching.cancel()
            self.schedule.finished(peer_id, direct=False, detail="stopped", now=self.clock())
            if not flight.done():
                flight.set_exception(TransportError(f"punching to {peer_id} stopped"))
                flight.exception()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise
        else:
            self.schedule.finished(peer_id, direct=True, detail="punched", now=self.clock())
            logger.info("direct link to peer %s through its NAT", peer_id)
            self._retire_relayed(link)
            if not flight.done():
                flight.set_result(link)
        finally:
            if self._flights.get(peer_id) is flight:
                del self._flights[peer_id]

    async def _punch(self, endpoint: PunchEndpoint) -> PeerLink:
        window = self.schedule.window(endpoint.peer_id)
        self.schedule.began(endpoint.peer_id)
        timeout = self.pool.config.request_timeout
        sock = await simultaneous_open(self.port, endpoint.host, endpoint.port, timeout=window)
        label = endpoint.address
        if dials_first(self.own_id, endpoint.peer_id):
            conn = await self.websocket.connect_socket(sock, label, timeout=timeout)
            link = await self.pool.adopt(conn, endpoint.peer_id, inbound=False)
            self._watch(link)
            return link
        adopted: asyncio.Future[PeerLink] = asyncio.get_running_loop().create_future()

        async def serve(conn: Connection) -> None:
            try:
                link = await self.pool.adopt(conn, endpoint.peer_id, inbound=True)
            except BaseException as exc:
                if not adopted.done():
                    adopted.set_exception(exc)
                raise
            adopted.set_result(link)
            self._watch(link)
            await self.pool.serve(link)

        task = asyncio.get_running_loop().create_task(
            self.websocket.serve_socket(sock, label, serve)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            async with asyncio.timeout(timeout * 2):
                return await asyncio.shield(adopted)
        except BaseException:
            task.cancel()
            raise

    def _keep_public_links(self, now: float) -> None:
        """A node others cannot dial keeps a direct link to the public members it knows
        (see the module's docstring); each one dialed at most once per ``window_s``."""
        if self.keep_public == 0 or any(_dialable(a) for a in self.pool.addresses()):
            return
        members = self.pool.members()
        public = sorted(
            (peer_id, [a for a in member.addresses if _dialable(a)])
            for peer_id, member in members.items()
            if peer_id != self.own_id and any(_dialable(a) for a in member.addresses)
        )[: self.keep_public]
        for peer_id in list(self._keeping):
            if peer_id not in members:
                del self._keeping[peer_id]
        for peer_id, addresses in public:
            if self._linked_directly(peer_id) or peer_id in self.pool.dialing:
                continue
            if now < self._keeping.get(peer_id, -math.inf) + self.schedule.window_s:
                continue
            self._keeping[peer_id] = now
            self._spawn(self._dial_public(peer_id, addresses))

    async def _dial_public(self, peer_id: str, addresses: list[str]) -> None:
        for address in addresses:
            try:
                link = await self.pool.connect(address, peer_id)
            except (TransportError, ProtocolError, AuthenticationError, OSError) as exc:
                logger.debug("cannot dial public peer %s at %s: %s", peer_id, address, exc)
                continue
            logger.info("direct link to public peer %s", peer_id)
            self._retire_relayed(link)
            return

    def _relay_if_unlinked(self, peer_id: str) -> None:
        """Link to ``peer_id`` through its relays, unless linked already or on the way."""
        fallback = self._fallbacks.get(peer_id)
        if fallback and not self._linked(peer_id) and peer_id not in self._relaying:
            self._spawn(self._link_through(peer_id, fallback))

    def _retire_relayed(self, punched: PeerLink) -> None:
        """A punched link came: the relayed links to the same peer are retired (the
        relay carries only pairs that cannot link directly)."""
        for link in self.pool.open_links_to(punched.peer_id):
            if link is not punched and via_relay(link):
                logger.info("link to peer %s through a relay retired: punched", link.peer_id)
                self.pool.retire(link)

    async def _link_through(self, peer_id: str, addresses: list[str]) -> None:
        self._relaying.add(peer_id)
        try:
            link = await self.pool.link(peer_id, addresses)
        except (TransportError, OSError) as exc:
            logger.info("no path to peer %s through a relay either: %s", peer_id, exc)
            return
        finally:
            self._relaying.discard(peer_id)
        if not via_relay(link):
            return  # a punched link came first
        logger.info("linked to peer %s through a relay", peer_id)
        if self.on_link is not None:
            with contextlib.suppress(Exception):  # as for a punched link
                await self.on_link(link)

    def _spawn(self, coro: Coroutine[object, object, object]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _watch(self, link: PeerLink) -> None:
        async def watch() -> None:
            if self.on_link is not None:
                with contextlib.suppress(Exception):  # what gossip would do in a round
                    await self.on_link(link)
            while not link.closed:
                await link.wait_closed(60.0)
            self.schedule.lost(link.peer_id, self.clock())
            self._wake.set()

        task = asyncio.get_running_loop().create_task(watch())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.port.close()


def _dialable(address: str) -> bool:
    """An address any peer may dial (not one punched toward, nor a relay's)."""
    return address.startswith(("ws://", "wss://"))
