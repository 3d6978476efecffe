"""A node's tunables (:class:`NodeConfig`), apart so that the node's parts can read them
without importing the node."""

from __future__ import annotations

from dataclasses import dataclass, field

from peer.wire import Limits

__all__ = ["NodeConfig"]


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Tunables of one node. Defaults suit a real swarm; tests shorten the periods."""

    host: str = "127.0.0.1"
    port: int = 0
    client_mode: bool = False
    announce_addresses: tuple[str, ...] | None = None
    gossip_period: float = 1.0  # seconds between anti-entropy rounds (±25 % jitter)
    fanout: int = 3  # peers contacted per round
    # a stored record is pushed at once to ``fanout`` peers, which relay what is new to them
    # this many times more (each to ``fanout`` others): fresh values reach a swarm of
    # dozens in milliseconds, not rounds; anti-entropy still brings them to everyone
    push_relays: int = 2
    member_ttl: float = 30.0  # a silent peer leaves membership after this long
    request_timeout: float = 5.0
    max_links: int = 64  # idle links beyond this are closed, least recently used first
    link_idle_grace: float = 10.0  # a link used this recently is never closed as idle
    max_exchange_bytes: int = 512 * 1024  # records sent per exchange; the rest wait a round
    max_record_ttl: float = 7 * 24 * 3600.0
    # the gossip store's total (peer.node.gossip.record_cost): past it, each owner keeps a
    # fair share and the largest holders make room (identities cannot fill it together)
    max_store_bytes: int = 32 << 20
    retry_backoff: float = 5.0  # seconds before dialing a peer that just failed again
    # an initial (bootstrap) address that did not answer this many times in a row is dropped;
    # the first three retries come every gossip round, then after a doubling wait (up to a
    # minute). A peer that answers there and fails half-way (a lossy link) is retried every
    # round and kept
    bootstrap_attempts: int = 8
    # a peer whose membership expired without a goodbye is dialed again (one such peer per
    # interval; None: every member_ttl) until it is back or this many seconds have passed,
    # so a swarm split by a fault longer than member_ttl heals (peer.node.reconnect)
    reconnect_interval: float | None = None
    reconnect_give_up: float = 3600.0
    # inbound connections still in their handshake; more are closed at once (each one may
    # hold a small pre-authentication buffer until its handshake times out)
    max_pending_handshakes: int = 64
    # ... and of those, from one source (an IP address, an IPv6 /56): a stranger's idle
    # connections cannot take every place and lock honest peers out
    max_pending_handshakes_per_source: int = 16
    bulk_lanes: bool = True  # TCP side lanes for tensor parts (peer.transport.bulk), if TCP
    bulk_port: int = 0  # the lanes' listening port (0: any free one; set it behind a firewall)
    # links and lanes sealed with keys from each handshake (peer.transport.secure); False
    # only on a network where nobody can read or alter traffic: every peer must agree
    encryption: bool = True
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.gossip_period <= 0 or self.fanout < 1 or self.member_ttl <= self.gossip_period:
            raise ValueError("need gossip_period > 0, fanout >= 1 and member_ttl > gossip_period")
        if self.push_relays < 0 or self.bootstrap_attempts < 1:
            raise ValueError("need push_relays >= 0 and bootstrap_attempts >= 1")
        if self.max_store_bytes < 1 << 16:
            raise ValueError("max_store_bytes must be at least 64 KiB")
        if self.max_pending_handshakes < 1 or self.max_pending_handshakes_per_source < 1:
            raise ValueError(
                "max_pending_handshakes and max_pending_handshakes_per_source must be >= 1"
            )
        if (self.reconnect_interval is not None and self.reconnect_interval <= 0) or (
            self.reconnect_give_up <= 0
        ):
            raise ValueError("need reconnect_interval > 0 and reconnect_give_up > 0")
