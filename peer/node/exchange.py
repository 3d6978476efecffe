"""A node's gossip (:class:`Gossip`, a part of :class:`peer.node.core.AsyncNode`): push-pull
rounds, pushes and their relays.

Every ``gossip_period`` (jittered) a node starts a round with up to ``fanout`` peers (and
any initial peer not reached yet). Most exchanges are *rumour* exchanges over the digest of
recent news (:mod:`peer.node.cost`): each side sends what the other lacks or holds older.
Now and then (always in a small swarm, at bootstrap and for ``get(..., latest=True)``) an
exchange compares whole stores instead. So a round costs O(log N) bytes on average, a record
reaches every peer in O(log N) rounds, and what a rumour missed is caught later.

A round never waits for its slowest exchange. A store is also pushed at once to a few peers,
which relay what was news to them. What an exchange brings is checked before it is stored
(:mod:`peer.node.intake`); a peer that relays forged records loses its link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine, Sequence

from peer.exceptions import (
    AuthenticationError,
    ConnectionClosed,
    ProtocolError,
    RemoteError,
    SwarmgradError,
    TransportError,
)
from peer.node.certificates import CertificateBook, certificates_for, sendable, take_within_budget
from peer.node.config import NodeConfig
from peer.node.cost import full_sync_chance, news_rounds
from peer.node.gossip import (
    DIGEST_ENTRY_BYTES,
    RECORD_ID_BYTES,
    GossipStore,
    Record,
    RecordError,
    digest_entries,
)
from peer.node.intake import Intake
from peer.node.links import Handler, PeerLink
from peer.node.membership import Member
from peer.node.reconnect import Reconnector
from peer.node.trust import Trust
from peer.wire import (
    BYTES,
    INT,
    AnyValue,
    Frame,
    Limits,
    ListOf,
    MessageRegistry,
    Scalar,
    Schema,
)

logger = logging.getLogger("peer.node")

__all__ = [
    "GOSSIP_DIGEST",
    "GOSSIP_FETCH",
    "GOSSIP_NEWS",
    "GOSSIP_PUSH",
    "GOSSIP_REPLY",
    "Gossip",
]

GOSSIP_DIGEST = "gossip.digest"  # whole-store comparison
GOSSIP_NEWS = "gossip.news"  # rumour exchange: the digest of recent records only
GOSSIP_FETCH = "gossip.fetch"  # the records of ids a rumour exchange offered
GOSSIP_REPLY = "gossip.reply"
GOSSIP_PUSH = "gossip.push"


def want_budget(limits: Limits, max_exchange_bytes: int) -> int:
    """How many record ids one ``gossip.reply`` asks for: what its ``want`` field may hold
    (:attr:`~peer.wire.Limits.max_string_length`), and no more records than one push of
    ``max_exchange_bytes`` could carry (each costs at least :data:`MIN_RECORD_BYTES`)."""
    return max(
        1, min(limits.max_string_length // RECORD_ID_BYTES, max_exchange_bytes // MIN_RECORD_BYTES)
    )


MIN_RECORD_BYTES = 128  # what take_within_budget counts for a record beyond its value and key


def _answered(error: BaseException) -> bool:
    """Whether a failed dial met a peer: the connection opened and its handshake or first
    exchange failed (what a lossy link does), rather than nothing answering at all (the
    transport's own refusal or timeout to connect)."""
    return isinstance(error, ConnectionClosed) or not isinstance(error, TransportError)


def _record_ids(want: bytes) -> list[bytes]:
    """The record ids packed in a ``want`` field; ProtocolError if it is not whole ids."""
    if len(want) % RECORD_ID_BYTES:
        raise ProtocolError("'want' is not a whole number of record ids")
    return [want[i : i + RECORD_ID_BYTES] for i in range(0, len(want), RECORD_ID_BYTES)]


class Gossip:
    """A node's gossip rounds and exchanges over its store. The node owns one and hands it
    what it needs: its ``config``, ``peer_id``, ``store``, ``trust`` (certificates and
    bans), message ``registry`` and ``register(message_type, schema, handler)``, random
    source ``rng``, ``reconnect`` (departed peers to dial again), ``watchers`` (key →
    callbacks for fresh records), its open ``links`` and ``failed_at`` (peer id → loop time
    of its last failure), and its functions ``now()``, ``members()``, ``link(peer_id)``
    (an open or new link), ``connect(address, expected_peer_id)`` (a new link),
    ``peer_failed(peer_id, reason)`` and ``spawn(coroutine, name)`` (a task the node stops
    at shutdown)."""

    def __init__(
        self,
        *,
        config: NodeConfig,
        peer_id: str,
        store: GossipStore,
        trust: Trust,
        registry: MessageRegistry,
        register: Callable[[str, Schema, Handler], None],
        rng: random.Random,
        reconnect: Reconnector,
        watchers: dict[str, list[Callable[[], None]]],
        links: dict[str, PeerLink],
        failed_at: dict[str, float],
        now: Callable[[], float],
        members: Callable[[], dict[str, Member]],
        link: Callable[[str], Awaitable[PeerLink]],
        connect: Callable[[str, str | None], Awaitable[PeerLink]],
        peer_failed: Callable[[str, str], None],
        spawn: Callable[[Coroutine[object, object, object], str], object],
        initial_peers: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.peer_id = peer_id
        self.store_ = store
        self.trust = trust
        self.registry = registry
        self.random = rng
        self._reconnect = reconnect
        self._links = links
        self._failed_at = failed_at
        self.now = now
        self.members = members
        self.link = link
        self._connect = connect
        self._peer_failed = peer_failed
        self._spawn = spawn
        self.initial_peers = [str(a) for a in initial_peers]
        self._added_peers: set[str] = set()  # initial peers from add_initial_peers
        self._bootstrapped: set[str] = set()  # initial peers reached at least once
        self._dial_failures: dict[str, tuple[int, float]] = {}  # initial peer → (failures
        # in a row, loop time of the last): see NodeConfig.bootstrap_attempts
        # initial peer not reached yet → the peer id its last handshake found there
        self._answered_at: dict[str, str] = {}
        # peers and addresses with a gossip exchange under way: a round skips them, so one
        # that does not answer holds up only its own exchange, never the rounds
        self._exchanging: set[str] = set()
        self._intake = Intake(trust, watchers)
        self.rounds = 0
        self.exchanges = 0  # exchanges this node started and saw answered
        self.full_exchanges = 0  # ... and those (started or answered) comparing whole stores
        self.swarm_size = 1  # live members at the last round (peer.node.cost)
        self._register(register)

    @property
    def certificates(self) -> CertificateBook | None:
        return self.trust.certificates

    def _register(self, register: Callable[[str, Schema, Handler], None]) -> None:
        record_list = ListOf(AnyValue())
        # certificate mode: [owner public key, certificate] for the owners of the records
        certs = ListOf(ListOf(Scalar(bytes, max_length=4096), exact_length=2))
        # The digest travels as the raw payload (see GossipStore.digest); "want" is packed ids.
        register(GOSSIP_DIGEST, Schema(payload=True), self._on_digest)
        register(GOSSIP_NEWS, Schema(payload=True), self._on_news)
        register(GOSSIP_FETCH, Schema(required={"want": BYTES}), self._on_fetch)
        self.registry.register(
            GOSSIP_REPLY,
            Schema(
                required={"records": record_list, "want": BYTES},
                optional={"certs": certs, "offer": BYTES},
            ),
        )
        register(
            GOSSIP_PUSH,
            Schema(required={"records": record_list}, optional={"h": INT, "certs": certs}),
            self._on_push,
        )

    def records_fields(self, records: list[Record], now: float) -> dict[str, object]:
        """A frame's ``records`` and, in certificate mode, their owners' ``certs``."""
        fields: dict[str, object] = {"records": [r.to_wire() for r in records]}
        certs = certificates_for(records, self.certificates, now)
        if certs:
            fields["certs"] = certs
        return fields

    async def bootstrap(self) -> None:
        """Exchange with every initial peer once, right away, so membership is known before
        the first regular round."""
        results = await asyncio.gather(
            *(self.exchange_with_address(a) for a in self.initial_peers), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures and len(failures) == len(results):
            logger.warning(
                "could not reach any initial peer yet (%s); will keep trying", failures[0]
            )

    async def add_initial_peers(self, addresses: Sequence[str]) -> int:
        """Dial ``addresses`` now and keep them as initial peers (see
        :meth:`peer.node.core.AsyncNode.add_initial_peers`). Returns how many answered."""
        fresh = list(dict.fromkeys(str(a) for a in addresses))
        kept = [a for a in self.initial_peers if a not in self._added_peers]
        self._added_peers = set(fresh) - set(kept)
        self.initial_peers = kept + [a for a in fresh if a not in kept]
        self._answered_at = {a: p for a, p in self._answered_at.items() if a in self.initial_peers}
        self._bootstrapped.difference_update(fresh)
        for address in fresh:  # handed out again: each gets its attempts again
            self._dial_failures.pop(address, None)
        results = await asyncio.gather(
            *(self.exchange_with_address(a) for a in fresh), return_exceptions=True
        )
        reached = sum(not isinstance(r, BaseException) for r in results)
        if fresh and not reached:
            logger.info("none of %d new initial peer(s) answered yet; will keep trying", len(fresh))
        return reached

    async def exchange_with_address(self, address: str) -> None:
        """Exchange with whoever answers at ``address``: over the link a handshake there
        opened before, if it is still open (an initial peer whose first exchange failed on
        a lossy link is not dialed all over again), else over a new one."""
        link = self._links.get(self._answered_at.pop(address, ""))
        reused = link is not None and not link.closed
        if not reused:
            link = None
        try:
            if link is None:
                link = await self._connect(address, None)
            await self.exchange(link)
        except (SwarmgradError, TimeoutError) as exc:
            if link is not None and not reused and address in self.initial_peers:
                self._answered_at[address] = link.peer_id  # reused once, then dialed anew
            self._dial_failed(address, answered=_answered(exc))
            raise
        self._dial_failures.pop(address, None)
        self._bootstrapped.add(address)

    def _dial_failed(self, address: str, *, answered: bool) -> None:
        """Count a failed dial of an initial peer; drop the address after
        ``bootstrap_attempts`` in a row without an answer (a bootstrap list may name
        addresses that never answer, or were never peers at all: they are not dialed
        forever). A peer that answered (its handshake or first exchange failed half-way: a
        lossy link) is dialed again at the next round and kept: giving up on the only peer
        that links this node to the swarm would split it off for good."""
        if address not in self.initial_peers:
            return  # a departed peer's address: the reconnector bounds those
        if answered:
            self._dial_failures.pop(address, None)
            return
        self._answered_at.pop(address, None)
        failures = self._dial_failures.get(address, (0, 0.0))[0] + 1
        self._dial_failures[address] = (failures, asyncio.get_running_loop().time())
        if failures >= self.config.bootstrap_attempts:
            self.initial_peers.remove(address)
            self._dial_failures.pop(address, None)
            logger.warning(
                "initial peer %s did not answer %d times in a row: no longer dialing it",
                address,
                failures,
            )

    def _dial_due(self, address: str) -> bool:
        """Whether an initial peer that did not answer before may be dialed again: the first
        few retries come every gossip round (a dial can time out on a congested link without
        the address being bad), then the wait doubles with each failure in a row, up to a
        minute."""
        failed = self._dial_failures.get(address)
        if failed is None:
            return True
        failures, at = failed
        wait: float = min(self.config.gossip_period * 2 ** max(0, failures - 3), 60.0)
        return asyncio.get_running_loop().time() - at >= wait

    def _gossip_targets(self, exclude: str | None = None) -> list[str]:
        candidates = [p for p in self._gossip_candidates(exclude) if p not in self._exchanging]
        return self.random.sample(candidates, min(self.config.fanout, len(candidates)))

    def _gossip_candidates(self, exclude: str | None = None) -> list[str]:
        """Peers to gossip with: known, reachable, not failed just now."""
        loop_now = asyncio.get_running_loop().time()
        candidates = []
        for member in self.members().values():
            if member.peer_id in (self.peer_id, exclude):
                continue
            failed = self._failed_at.get(member.peer_id)
            if failed is not None and loop_now - failed < self.config.retry_backoff:
                continue
            link = self._links.get(member.peer_id)
            if member.addresses or (link is not None and not link.closed):
                candidates.append(member.peer_id)
        return candidates

    async def round(self, *, full: bool = False) -> None:
        """One round: an exchange with up to ``fanout`` peers, each comparing whole stores
        if ``full`` or by chance (:func:`~peer.node.cost.full_sync_chance`), else news."""
        self.swarm_size = len(self.members())
        targets = self._gossip_targets()
        self.rounds += 1
        chance = 1.0 if full else full_sync_chance(self.swarm_size)
        whole = {p for p in targets if chance >= 1.0 or self.random.random() < chance}

        async def exchange(peer_id: str) -> None:
            await self._exchange_with_peer(peer_id, full=peer_id in whole)

        # Initial peers not yet reached stay on the list: a bootstrap that failed once must
        # not leave this node (and whoever bootstraps from it) in a separate swarm. When
        # alone (every known peer died), all initial peers are retried. An address that
        # keeps failing is dialed less and less often, then dropped (_dial_failed).
        retry = [
            a
            for a in self.initial_peers
            if (not targets or a not in self._bootstrapped) and self._dial_due(a)
        ]
        departed = self._reconnect.due(self.now(), self.members())
        if departed is not None and departed[1] not in retry:
            logger.debug("dialing departed peer %s at %s again", *departed)
            retry.append(departed[1])
        retry = [a for a in retry if a not in self._exchanging]
        await asyncio.gather(
            *(self._exclusively(p, exchange) for p in targets),
            *(self._exclusively(a, self.exchange_with_address) for a in retry),
            return_exceptions=True,
        )

    async def _exclusively(self, key: str, exchange: Callable[[str], Awaitable[None]]) -> None:
        """Run one gossip exchange, ``exchange(key)``, marking ``key`` (a peer id or an
        address) as under way. The exchange's coroutine is only made here: a round cancelled
        before this task starts (the node shutting down) leaves none behind unawaited."""
        self._exchanging.add(key)
        try:
            await exchange(key)
        finally:
            self._exchanging.discard(key)

    async def _exchange_with_peer(self, peer_id: str, *, full: bool = True) -> None:
        link: PeerLink | None = None
        try:
            link = await self.link(peer_id)
            await (self.exchange(link) if full else self.exchange_news(link))
        except ConnectionClosed as exc:
            if exc.clean:
                # The other side closed an idle link just as we used it: not a lost peer.
                logger.debug("link to %s closed during an exchange: %s", peer_id, exc)
            else:
                self._peer_failed(peer_id, str(exc))
        except ProtocolError as exc:
            if link is not None:
                await link.close(f"protocol error: {exc}")
            self._peer_failed(peer_id, f"protocol error: {exc}")
        except (
            TransportError,
            AuthenticationError,
            TimeoutError,
            RemoteError,
        ) as exc:
            self._peer_failed(peer_id, str(exc) or type(exc).__name__)

    async def exchange(self, link: PeerLink) -> None:
        """Push-pull: send a digest, take what the other side sends, push what it wants."""
        now = self.now()
        reply = await link.request(
            Frame(GOSSIP_DIGEST, payload=self.store_.digest(now)), self.config.request_timeout
        )
        if reply.type != GOSSIP_REPLY:
            raise ProtocolError(f"expected {GOSSIP_REPLY}, got {reply.type}")
        self.exchanges += 1
        self.full_exchanges += 1
        self._accept_records(reply.fields["records"], link, reply.fields.get("certs", ()))
        await self._push_wanted(link, reply.fields["want"])

    async def _push_wanted(self, link: PeerLink, want: bytes) -> None:
        """Push the records of the ids a reply asked for (what one push may carry)."""
        now = self.now()
        wanted = self.store_.get_by_ids(_record_ids(want), now)
        batch = take_within_budget(
            wanted, self.config.max_exchange_bytes, self.random, self.certificates, now
        )
        if batch:
            await link.send(Frame(GOSSIP_PUSH, self.records_fields(batch, now)))

    def _news_since(self, now: float) -> float:
        """When the records this node still offers as news arrived, at the latest."""
        return now - news_rounds(self.swarm_size) * self.config.gossip_period

    async def exchange_news(self, link: PeerLink) -> None:
        """Rumour exchange: send the digest of this node's news; take the newer copies the
        other side sends, push what it wants, fetch what it offered that is news here."""
        now = self.now()
        reply = await link.request(
            Frame(GOSSIP_NEWS, payload=self.store_.recent_digest(self._news_since(now), now)),
            self.config.request_timeout,
        )
        if reply.type != GOSSIP_REPLY:
            raise ProtocolError(f"expected {GOSSIP_REPLY}, got {reply.type}")
        self.exchanges += 1
        self._accept_records(reply.fields["records"], link, reply.fields.get("certs", ()))
        await self._push_wanted(link, reply.fields["want"])
        try:
            missing, _ = self.store_.wanted(
                digest_entries(reply.fields.get("offer", b"")), self.now()
            )
        except RecordError as exc:
            raise ProtocolError(f"gossip.reply: {exc}") from None
        budget = want_budget(self.config.limits, self.config.max_exchange_bytes)
        if len(missing) > budget:
            missing = self.random.sample(missing, budget)
        if not missing:
            return
        fetched = await link.request(
            Frame(GOSSIP_FETCH, {"want": b"".join(missing)}), self.config.request_timeout
        )
        if fetched.type != GOSSIP_REPLY:
            raise ProtocolError(f"expected {GOSSIP_REPLY}, got {fetched.type}")
        self._accept_records(fetched.fields["records"], link, fetched.fields.get("certs", ()))

    async def _on_news(self, link: PeerLink, frame: Frame) -> Frame:
        now = self.now()
        try:
            listed = digest_entries(frame.payload)
        except RecordError as exc:
            raise ProtocolError(str(exc)) from None
        theirs_newer, mine_newer = self.store_.wanted(listed, now)
        # the news here that the other side did not list: it fetches what it lacks
        # (newest first, as many as the field may carry: the rest wait for a later round)
        fits = self.config.limits.max_string_length // DIGEST_ENTRY_BYTES
        offer = self.store_.recent_digest(self._news_since(now), now, exclude=listed, limit=fits)
        batch = take_within_budget(
            mine_newer, self.config.max_exchange_bytes, self.random, self.certificates, now
        )
        budget = want_budget(self.config.limits, self.config.max_exchange_bytes)
        if len(theirs_newer) > budget:
            theirs_newer = self.random.sample(theirs_newer, budget)
        return Frame(
            GOSSIP_REPLY,
            {**self.records_fields(batch, now), "want": b"".join(theirs_newer), "offer": offer},
        )

    async def _on_fetch(self, link: PeerLink, frame: Frame) -> Frame:
        now = self.now()
        records = self.store_.get_by_ids(_record_ids(frame.fields["want"]), now)
        batch = take_within_budget(
            records, self.config.max_exchange_bytes, self.random, self.certificates, now
        )
        return Frame(GOSSIP_REPLY, {**self.records_fields(batch, now), "want": b""})

    async def _on_digest(self, link: PeerLink, frame: Frame) -> Frame:
        self.full_exchanges += 1
        now = self.now()
        try:
            mine_newer, theirs_newer = self.store_.compare(frame.payload, now)
        except RecordError as exc:
            raise ProtocolError(str(exc)) from None
        batch = take_within_budget(
            mine_newer, self.config.max_exchange_bytes, self.random, self.certificates, now
        )
        # the ids wanted in one reply fit its field's limit and the records the other side
        # pushes per exchange; the rest are asked for in later rounds
        budget = want_budget(self.config.limits, self.config.max_exchange_bytes)
        if len(theirs_newer) > budget:
            theirs_newer = self.random.sample(theirs_newer, budget)
        return Frame(
            GOSSIP_REPLY, {**self.records_fields(batch, now), "want": b"".join(theirs_newer)}
        )

    async def _on_push(self, link: PeerLink, frame: Frame) -> None:
        fresh = self._accept_records(frame.fields["records"], link, frame.fields.get("certs", ()))
        # never more relays than this node would ask for itself (no amplification)
        relays = min(frame.fields.get("h", 0), self.config.push_relays)
        if fresh and relays > 0:
            # pass on what was news here (once: a record seen before is not news again)
            self._spawn(self.push_now(fresh, relays - 1, exclude=link.peer_id), "relay")
        return None

    def _accept_records(
        self, items: Sequence[object], link: PeerLink, certs: Sequence[list[bytes]] = ()
    ) -> list[Record]:
        """Verify and store records ``link``'s peer sent (:class:`~peer.node.intake.Intake`);
        those that were news."""
        return self._intake.accept(self.store_, items, link.peer_id, certs, self.now())

    async def push_now(
        self, records: list[Record], relays: int = 0, exclude: str | None = None
    ) -> None:
        """Push ``records`` to up to ``fanout`` peers over open links, asking each to relay
        what is new to it ``relays`` more times."""
        now = self.now()
        records = sendable(records, self.certificates, now)
        if not records:
            return
        candidates = self._gossip_candidates(exclude)
        if len(candidates) <= self.config.fanout:
            relays = 0  # this push reaches every peer there is: nothing to relay
        targets = self.random.sample(candidates, min(self.config.fanout, len(candidates)))
        fields = self.records_fields(records, now)
        if relays:
            fields["h"] = relays
        payload = Frame(GOSSIP_PUSH, fields)
        for peer_id in targets:
            link = self._links.get(peer_id)
            if link is None or link.closed:
                continue  # pushing is opportunistic; the next round carries it anyway
            with contextlib.suppress(SwarmgradError):
                await link.send(payload)

    async def loop(self) -> None:
        period = self.config.gossip_period
        while True:
            await asyncio.sleep(period * self.random.uniform(0.75, 1.25))
            # Not awaited: a round lasts as long as its slowest exchange (up to the request
            # timeout for a peer that stopped answering, e.g. across a network partition),
            # and the others must still hear from this node every period. A peer whose
            # exchange is still under way is left out of the next rounds meanwhile.
            self._spawn(self._round_logged(), "gossip-round")

    async def _round_logged(self) -> None:
        try:
            await self.round()
        except SwarmgradError as exc:
            logger.debug("gossip round failed: %s", exc)
