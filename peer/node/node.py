"""``peer.Node``: the synchronous face of :class:`~peer.node.core.AsyncNode`.

One asyncio event loop runs in a background thread; every public method submits a
coroutine to it and waits, so a training loop can call ``store``/``get`` without knowing
about asyncio. Layers built on the node (the averager) run their own coroutines on the same
loop through :meth:`Node.run_coroutine`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Literal, ParamSpec, TypeVar, overload

from peer.exceptions import NodeShutdown
from peer.formats.identity import Authenticator, Identity, OpenAuth
from peer.formats.open_types import UserMetadata
from peer.node.core import AsyncNode, Member, NodeConfig, check_open_mode
from peer.node.gossip import Subkey, ValueWithExpiration
from peer.node.punching import PunchOutcome
from peer.transport.base import Transport
from peer.transport.punch import PunchEndpoint, PunchPort
from peer.transport.relay import RelayTransport
from peer.transport.websocket import WebSocketTransport
from peer.wire import Limits

T = TypeVar("T")
P = ParamSpec("P")


class LoopThread:
    """An event loop running in a daemon thread, stopped and joined by :meth:`stop`."""

    def __init__(self, name: str = "swarmgrad-node") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[object, object, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_closed():
            return

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(drain(), self.loop).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
        self.loop.close()


class Node:
    """A peer in the swarm: authenticated connections, membership and a gossip store.

    ``Node(initial_peers)`` joins the swarm through any of ``initial_peers`` (addresses like
    ``ws://host:port``, from another node's :attr:`visible_addresses` or the coordinator's
    bootstrap list). ``client_mode=True`` accepts no inbound connections (behind NAT or a
    firewall): the node still takes part by dialing out.

    Authentication: ``SwarmKeyAuth(key)``, ``CertificateAuth(certificate, verify)`` or
    ``OpenAuth()`` (anyone may join); every peer of a swarm must use the same mode. Without
    ``auth`` a node is open, which it only accepts while it listens on a loopback address
    (local experiments): to listen elsewhere without authentication, pass ``auth=OpenAuth()``
    on purpose (``ValueError`` otherwise).

    Encryption: every link and bulk lane is sealed (AES-256-GCM, keys agreed in each
    authenticated handshake). ``encryption=False`` sends everything in clear, for a network
    where nobody can read or alter traffic (a private cluster); every peer of the swarm must
    pass the same, and a peer that does not is refused at the handshake.

    Relays: a node dials ``relay://host:port/<peer id>`` addresses through that relay; given
    ``relays=["relay://host:port"]`` it also registers with each (certificate mode only) and
    its addresses include ``relay://host:port/<its peer id>``, so peers that cannot dial it
    directly reach it through the relay (:mod:`peer.transport.relay`).

    Hole punching: given ``punch_port`` (0: any free port), a node behind a NAT punches
    links toward the peers :meth:`introduce` names (the coordinator's rendezvous list) and
    dials ``punch://`` addresses that way (:mod:`peer.node.punching`); announced at its own
    ``punch://`` address, it is a full member of the swarm though it cannot be dialed.

    Use as a context manager, or call :meth:`shutdown` when done.
    """

    def __init__(
        self,
        initial_peers: Sequence[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        client_mode: bool = False,
        start: bool = True,
        identity: Identity | None = None,
        auth: Authenticator | None = None,
        announce_addresses: Sequence[str] | None = None,
        transport: Transport | None = None,
        gossip_period: float = 1.0,
        fanout: int = 3,
        push_relays: int = 2,
        member_ttl: float = 30.0,
        request_timeout: float = 5.0,
        limits: Limits | None = None,
        loop_thread: LoopThread | None = None,
        bulk_lanes: bool = True,
        bulk_port: int = 0,
        encryption: bool = True,
        relays: Sequence[str] = (),
        punch_port: int | None = None,
    ) -> None:
        if isinstance(initial_peers, str):
            raise TypeError('initial_peers is a list of addresses, e.g. ["ws://127.0.0.1:4000"]')
        self.config = NodeConfig(
            host=host,
            port=port,
            client_mode=client_mode,
            announce_addresses=tuple(announce_addresses) if announce_addresses else None,
            gossip_period=gossip_period,
            fanout=fanout,
            push_relays=push_relays,
            member_ttl=member_ttl,
            request_timeout=request_timeout,
            limits=limits or Limits(),
            bulk_lanes=bulk_lanes,
            bulk_port=bulk_port,
            encryption=encryption,
        )
        check_open_mode(auth, self.config)  # before anything starts (AsyncNode checks too)
        self._identity = identity or Identity()
        self._auth = auth
        if relays and (transport is not None or client_mode):
            raise ValueError(
                "relays= registers a listening node with relays: it needs the default "
                "transport and client_mode=False"
            )
        self._transport = transport or RelayTransport(
            WebSocketTransport(max_message_bytes=self.config.limits.max_frame_bytes),
            identity=self._identity,
            auth=lambda: self._auth if self._auth is not None else OpenAuth(),
            relays=relays,
        )
        self._initial_peers = list(initial_peers or ())
        if punch_port is not None and (transport is not None or not 0 <= punch_port <= 65535):
            raise ValueError("punch_port is a port (0: any) and needs the default transport")
        self._punch_port = punch_port
        self._owns_loop = loop_thread is None
        self._loop_thread = loop_thread
        self._core: AsyncNode | None = None
        self._shutdown = False
        if start:
            self.run()

    # lifecycle -----------------------------------------------------------------------------

    def run(self) -> None:
        """Start the node (done by the constructor unless ``start=False``)."""
        if self._core is not None:
            return
        if self._loop_thread is None:
            self._loop_thread = LoopThread(f"swarmgrad-node-{self._identity.peer_id[:8]}")

        async def create() -> AsyncNode:
            core = AsyncNode(
                self._initial_peers,
                transport=self._transport,
                identity=self._identity,
                auth=self._auth,
                config=self.config,
            )
            if self._punch_port is not None:
                # every local address: the coordinator names the endpoint its requests come
                # from (the system's choice of source address, whatever host the node
                # listens on), and a punch from a narrower bind would leave from another
                wildcard = "::" if ":" in self.config.host else "0.0.0.0"
                core.start_punching(PunchPort(self._punch_port, host=wildcard))
            await core.start()
            return core

        try:
            self._core = self._loop_thread.submit(create()).result()
        except BaseException:
            if self._owns_loop:
                self._loop_thread.stop()
            raise

    def shutdown(self) -> None:
        """Stop gossip, close every connection and the listener, and stop the loop thread
        (if this node owns it). Idempotent."""
        if self._shutdown:
            return
        self._shutdown = True
        if self._core is not None and self._loop_thread is not None:
            self._loop_thread.submit(self._core.shutdown()).result()
        if self._owns_loop and self._loop_thread is not None:
            self._loop_thread.stop()

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # properties ----------------------------------------------------------------------------

    @property
    def core(self) -> AsyncNode:
        if self._shutdown:
            raise NodeShutdown("the node is shut down")
        if self._core is None:
            raise NodeShutdown("the node is not running; call run() or create it with start=True")
        return self._core

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop_thread is not None
        return self._loop_thread.loop

    @property
    def peer_id(self) -> str:
        return self._identity.peer_id

    @property
    def identity(self) -> Identity:
        return self._identity

    @property
    def client_mode(self) -> bool:
        return self.config.client_mode

    @property
    def visible_addresses(self) -> list[str]:
        """Addresses other peers can dial (empty in client mode)."""
        return self.core.visible_addresses

    def is_alive(self) -> bool:
        return self._core is not None and not self._shutdown

    # API -------------------------------------------------------------------------------------

    @overload
    def run_coroutine(
        self, coro: Coroutine[object, object, T], *, wait: Literal[True] = True
    ) -> T: ...
    @overload
    def run_coroutine(
        self, coro: Coroutine[object, object, T], *, wait: Literal[False]
    ) -> concurrent.futures.Future[T]: ...
    @overload
    def run_coroutine(
        self, coro: Coroutine[object, object, T], *, wait: bool = True
    ) -> T | concurrent.futures.Future[T]: ...
    def run_coroutine(
        self, coro: Coroutine[object, object, T], *, wait: bool = True
    ) -> T | concurrent.futures.Future[T]:
        """Run ``coro`` on the node's event loop; returns its result, or a
        ``concurrent.futures.Future`` with ``wait=False``."""
        if self._shutdown or self._loop_thread is None:
            coro.close()
            raise NodeShutdown("the node is shut down")
        if self._loop_thread.thread is threading.current_thread():
            coro.close()
            raise RuntimeError(
                "a blocking Node call from its own event loop would deadlock; await the AsyncNode"
            )
        future = self._loop_thread.submit(coro)
        return future.result() if wait else future

    def store(self, key: str, value: object, expiration_time: float, subkey: Subkey = None) -> bool:
        """Store ``value`` (any msgpack-serialisable object) under ``key`` and, optionally,
        ``subkey`` until ``expiration_time`` (wall-clock seconds, e.g. ``get_time() + 30``).

        Returns False when this node already holds its own record in that slot with a later
        expiration. The record spreads to every peer by gossip within a few rounds."""
        return self.run_coroutine(self.core.store(key, value, expiration_time, subkey))

    def get(self, key: str, latest: bool = False) -> ValueWithExpiration[UserMetadata] | None:
        """``(value, expiration_time)`` for ``key``, or None if nothing live is known. For a
        key stored with subkeys, ``value`` is a dict subkey → ``(value, expiration_time)``."""
        return self.run_coroutine(self.core.get(key, latest))

    def members(self) -> dict[str, Member]:
        """Live peers by peer id (including this one), as known from gossip."""
        core = self.core
        return self.run_coroutine(_call(core.members))

    @property
    def bytes_sent(self) -> int:
        """Bytes this node has sent so far (frame headers and payloads, every link and
        bulk lane): what a benchmark divides by the samples trained."""
        return int(self.core.bytes_sent)

    @property
    def num_links(self) -> int:
        """Peers this node has an open link to right now (0: cut off from the swarm)."""
        core = self.core
        return self.run_coroutine(_call(lambda: core.num_links))

    def revoke(self, data: bytes) -> bool:
        """Apply the run's revocation list (see :meth:`AsyncNode.revoke`): links to banned
        peers close, their records go, and the list is passed on. Whether it was news."""
        return bool(self.run_coroutine(_call(self.core.revoke, bytes(data))))

    def set_auth(self, auth: Authenticator) -> None:
        """Present ``auth`` in every later handshake, e.g. a renewed run certificate
        (``CertificateAuth``); open links stay as they are. The mode cannot change
        (``ValueError``)."""
        if self._core is None:
            current = self._auth if self._auth is not None else OpenAuth()
            if auth.mode != current.mode:
                raise ValueError(
                    f"this node authenticates with {current.mode!r}; it cannot switch to "
                    f"{auth.mode!r} (every peer of a swarm uses the same mode)"
                )
        else:
            self.run_coroutine(_call(self.core.set_auth, auth))
        self._auth = auth

    def add_initial_peers(self, addresses: Sequence[str]) -> int:
        """Dial ``addresses`` now and keep them as initial peers (retried until reached, and
        whenever this node is alone); they replace those of an earlier call. For a node that
        lost every peer: hand it fresh addresses, e.g. from the coordinator's bootstrap.
        Returns how many answered now."""
        return self.run_coroutine(self.core.add_initial_peers(addresses))

    def announce(self, addresses: Sequence[str]) -> None:
        """Have the swarm dial this node at ``addresses`` from now on (e.g. the address the
        coordinator reached it at, behind NAT): its membership record is republished and
        pushed to peers at once. ``ValueError`` in client mode."""
        core = self.core
        self.run_coroutine(_call(core.announce, addresses))

    @property
    def punch_port(self) -> int | None:
        """The port this node punches from (None: it does not punch)."""
        puncher = self.core.puncher
        return None if puncher is None else puncher.port.port

    def introduce(
        self,
        endpoints: Sequence[PunchEndpoint],
        fallbacks: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """The peers behind NATs to keep punched links with, as the coordinator saw them
        (replaces an earlier list), and the addresses to dial each at when the punch misses
        (its relay addresses). ``ValueError`` for a node without ``punch_port``."""
        puncher = self.core.puncher
        if puncher is None:
            raise ValueError("this node does not punch: give it punch_port")
        self.run_coroutine(_call(puncher.introduce, list(endpoints), dict(fallbacks or {})))

    def link_kinds(self) -> dict[str, int]:
        """Open links by how they go: ``direct`` (dialed or accepted), ``punched`` (through
        NATs) and ``relayed``."""

        async def count() -> dict[str, int]:
            kinds = {"direct": 0, "punched": 0, "relayed": 0}
            for link in self.core.pool.open_links():
                scheme = link.conn.remote_address.split("://", 1)[0]
                kinds[{"punch": "punched", "relay": "relayed"}.get(scheme, "direct")] += 1
            return kinds

        return dict(self.run_coroutine(count()))

    def punch_outcomes(self) -> dict[str, PunchOutcome]:
        """How the last punch toward each introduced peer ended."""
        puncher = self.core.puncher
        return {} if puncher is None else dict(puncher.outcomes())

    def get_time(self) -> float:
        """The wall-clock time that expirations are measured against."""
        return self.core.now()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "stopped"
        return f"Node(peer_id={self.peer_id!r}, {state})"


async def _call(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    return fn(*args, **kwargs)


def get_time() -> float:
    """Wall-clock seconds, the time base of expirations (hivemind's ``get_dht_time``)."""
    import time

    return time.time()
