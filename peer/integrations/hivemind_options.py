"""The options of hivemind's DHT that Lightning's ``HivemindStrategy`` takes, mapped onto what a
:class:`peer.Node` takes or refused, with the reason, when the strategy is built — never passed
on to the optimizer to fail at the first batch.

``host_maddrs`` maps: each ``/ip4/HOST/tcp/PORT`` (or ``/ip6/``, ``/dns/``) becomes the node's
``host`` and ``port``; a node listens on one address, so the TCP entries must name one; UDP
entries (hivemind's QUIC, ``/ip4/0.0.0.0/udp/0/quic`` in its default) are left out, the
swarm's links being WebSockets over TCP. The others have no counterpart and are accepted only
at hivemind's defaults.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, MutableMapping

_MULTIADDR = re.compile(r"/(ip4|ip6|dns|dns4|dns6)/([^/]+)/(tcp|udp)/(\d{1,5})(/.*)?")

# name -> (hivemind's default, why another value has no counterpart here)
REFUSED: dict[str, tuple[object, str]] = {
    "use_ipfs": (
        False,
        "there is no IPFS discovery: peers are found through initial_peers= or a "
        "coordinator's run (coordinator=, token=)",
    ),
    "use_relay": (True, "there are no libp2p relays: a peer behind NAT dials out (client mode)"),
    "use_auto_relay": (False, "there are no libp2p relays: a peer behind NAT dials out"),
    "wait_timeout": (3, "there are no Kademlia requests to time out: the node gossips"),
    "bootstrap_timeout": (None, "the node starts with whichever initial peers answer"),
    "identity_path": (
        None,
        "this machine's key is kept in data_dir= (a directory) when joining a coordinator's "
        "run, and is new for each open swarm",
    ),
}


def map_dht_options(host: str, port: int, options: MutableMapping[str, object]) -> tuple[str, int]:
    """The node's ``(host, port)`` once hivemind's DHT options are taken out of ``options``
    (the strategy's extra keyword arguments): ``host_maddrs`` mapped, the others accepted
    at hivemind's defaults only. ``ValueError`` naming the option otherwise."""
    for name, (default, reason) in REFUSED.items():
        if name in options:
            value = options.pop(name)
            if value != default:
                raise ValueError(f"{name}={value!r} has no counterpart here: {reason}")
    maddrs = options.pop("host_maddrs", None)
    if maddrs is None:
        return host, port
    if not isinstance(maddrs, Iterable):
        raise TypeError(f"host_maddrs: a multiaddr or a list of them, not {maddrs!r}")
    tcp: list[tuple[str, int]] = []
    for maddr in [maddrs] if isinstance(maddrs, str) else list(maddrs):
        match = _MULTIADDR.fullmatch(str(maddr))
        if match is None:
            raise ValueError(f"host_maddrs: {maddr!r} is not a multiaddr like /ip4/0.0.0.0/tcp/0")
        if match[3] == "udp":
            continue  # QUIC: the swarm's links are TCP
        if match[5]:
            raise ValueError(
                f"host_maddrs: {maddr!r} has more than a host and a TCP port "
                "(/ip4/HOST/tcp/PORT is what a node listens on)"
            )
        if int(match[4]) > 65535:
            raise ValueError(f"host_maddrs: {maddr!r} names no TCP port (0-65535)")
        tcp.append((match[2], int(match[4])))
    distinct = sorted(set(tcp))
    if len(distinct) != 1:
        raise ValueError(
            f"host_maddrs: a node listens on one TCP address; these name {len(distinct)} "
            f"({', '.join(f'{h}:{p}' for h, p in distinct) or 'none'})"
        )
    mapped = distinct[0]
    if (host, port) not in (("0.0.0.0", 0), mapped):
        raise ValueError(
            f"host_maddrs names {mapped[0]}:{mapped[1]} but host=/port= say {host}:{port}: "
            "pass one of them"
        )
    return mapped
