"""Rate limits as token buckets: pure bookkeeping, no clock, no socket.

A :class:`RateLimit` allows ``per_s`` requests per second sustained and ``burst`` at once;
:class:`TokenBuckets` keeps one bucket per client key for it, with time passed in (seconds
on any monotonic clock). A bucket that is full again is forgotten, and beyond ``max_keys``
the least recently used goes, so memory stays bounded.

:class:`RateLimiter` combines them for the coordinator's endpoints: per peer token and per
client address (:func:`address_key`: IPv6 per /56 by default, loopback exempt). The ASGI
layer around it is :mod:`server.api.rate_limits`.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

# Client keys that are not IP addresses (a Unix socket's peer, a name from a proxy) are cut
# to this length, so a hostile header cannot make a key large.
MAX_KEY_CHARS = 64

#: An IPv6 client counts with its whole network of this prefix length: what one subscriber
#: is commonly given (RIPE-690 recommends a /56 or a /48 per customer; a /64 is one LAN).
DEFAULT_IPV6_PREFIX = 56


class Endpoint(StrEnum):
    """The rate-limited endpoints; the value names them in refusals and metrics."""

    JOIN_CHALLENGE = "join_challenge"
    JOIN = "join"
    REPORTS = "reports"
    BOOTSTRAP = "bootstrap"
    CERTIFICATE = "certificate"
    LEAVE = "leave"
    DASHBOARD = "dashboard"


@dataclass(frozen=True, slots=True)
class RateLimit:
    """``per_s`` requests per second on average, up to ``burst`` at once."""

    per_s: float
    burst: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.per_s) and self.per_s > 0) or self.burst < 1:
            raise ValueError("a rate limit needs per_s > 0 and burst >= 1")


class TokenBuckets:
    """One :class:`RateLimit`'s buckets, one per client key."""

    def __init__(self, limit: RateLimit, max_keys: int = 50_000) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.limit = limit
        self._max_keys = max_keys
        self._refill_s = limit.burst / limit.per_s  # from empty to full
        # key -> (tokens, when last taken from); least recently taken from first
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def wait(self, key: Hashable, now: float) -> float:
        """Seconds until ``key`` may make a request: 0.0 when it may now."""
        tokens = self._tokens(key, now)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.limit.per_s

    def take(self, key: Hashable, now: float) -> None:
        """Count a request of ``key`` (call after :meth:`wait` said 0.0)."""
        tokens = self._tokens(key, now)
        self._buckets[key] = (max(0.0, tokens - 1.0), now)
        self._buckets.move_to_end(key)
        self._forget(now)

    def _tokens(self, key: Hashable, now: float) -> float:
        entry = self._buckets.get(key)
        if entry is None:
            return float(self.limit.burst)
        tokens, at = entry
        return min(float(self.limit.burst), tokens + max(0.0, now - at) * self.limit.per_s)

    def _forget(self, now: float) -> None:
        # The oldest first: once one was taken from too recently to be full, so were all after.
        buckets = self._buckets
        while buckets:
            key, (_, at) = next(iter(buckets.items()))
            if now - at < self._refill_s and len(buckets) <= self._max_keys:
                return
            del buckets[key]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request over a limit: which endpoint, whose bucket (the peer token's or the
    address's) and how long until it may come again."""

    endpoint: Endpoint
    by: Literal["peer", "address"]
    retry_after_s: float

    @property
    def reason(self) -> str:
        """What a peer's refusal fields record: ``rate_limit:<endpoint>``."""
        return f"rate_limit:{self.endpoint.value}"

    @property
    def retry_after_header(self) -> str:
        """Whole seconds for ``Retry-After``, rounded up, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


class RateLimiter:
    """The limits of one worker process. ``per_peer`` maps the endpoints limited per peer
    token to their limit, ``per_address`` those limited per client address; an endpoint in
    neither is not limited."""

    def __init__(
        self,
        per_peer: Mapping[Endpoint, RateLimit],
        per_address: Mapping[Endpoint, RateLimit],
        *,
        max_keys: int = 50_000,
        ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
    ) -> None:
        if not 1 <= ipv6_prefix <= 128:
            raise ValueError("ipv6_prefix is a prefix length, 1 to 128")
        self.ipv6_prefix = ipv6_prefix
        self._per_peer = {e: TokenBuckets(limit, max_keys) for e, limit in per_peer.items()}
        self._per_address = {e: TokenBuckets(limit, max_keys) for e, limit in per_address.items()}

    def address(self, host: str | None) -> str | None:
        """:func:`address_key` of ``host``, with this limiter's IPv6 prefix."""
        return address_key(host, self.ipv6_prefix)

    def limits_peers(self, endpoint: Endpoint) -> bool:
        return endpoint in self._per_peer

    def check(
        self, endpoint: Endpoint, address: Hashable, peer: Hashable | None, now: float
    ) -> Refusal | None:
        """Count a request of ``peer`` (a key for its token; None without one) from
        ``address`` (:func:`address_key`); a :class:`Refusal` instead if either bucket is
        empty, in which case neither is charged."""
        by_peer = self._per_peer.get(endpoint) if peer is not None else None
        by_address = self._per_address.get(endpoint)
        peer_wait = by_peer.wait(peer, now) if by_peer is not None else 0.0
        address_wait = by_address.wait(address, now) if by_address is not None else 0.0
        if peer_wait > 0.0 or address_wait > 0.0:
            by: Literal["peer", "address"] = "peer" if peer_wait >= address_wait else "address"
            return Refusal(endpoint, by, max(peer_wait, address_wait))
        if by_peer is not None:
            by_peer.take(peer, now)
        if by_address is not None:
            by_address.take(address, now)
        return None

    def keys(self) -> int:
        """Buckets held, all limits together (for tests and curiosity)."""
        return sum(len(b) for b in (*self._per_peer.values(), *self._per_address.values()))


def address_key(host: str | None, ipv6_prefix: int = DEFAULT_IPV6_PREFIX) -> str | None:
    """The key a client address is counted under, or None for a loopback client (exempt:
    the local demo and tests run whole swarms on loopback).

    An IPv4 address counts on its own, an IPv6 address with its network of ``ipv6_prefix``
    bits (a /56 by default: one subscriber commonly holds a /56 or a /48, so counting
    addresses, or /64s, would let it multiply its limit at will); an IPv4-mapped IPv6
    address as its IPv4 address. Anything else (a Unix socket's peer, no
    address at all) is counted as what it is, cut to :data:`MAX_KEY_CHARS`."""
    if not host:
        return "unknown"
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host[:MAX_KEY_CHARS]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, ipv6_prefix), strict=False))
    return str(ip)
