"""Port forwards a home router makes on request (UPnP-IGD), so that a volunteer behind it can
be dialled like a public peer.

:func:`map_ports` finds the router's Internet Gateway Device on the LAN (SSDP), asks it to
forward each of the node's TCP ports to this machine under the same port number, and
returns a :class:`PortMapping` that renews the forwards before their lease ends and
removes them on :meth:`PortMapping.close`. It returns None — and leaves nothing mapped —
when there is no such router, when it refuses a port (taken by another machine on the
LAN), or when its own public address is not a global one (a second NAT, such as a
carrier's, sits behind it: a forward there reaches no one). Whether the forward really
lets the Internet in is then for the coordinator's reachability check to say.

The router is reached through :class:`Gateway`, which the ``miniupnpc`` binding satisfies;
tests hand in their own.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger("peer.transport.port_mapping")

__all__ = ["Gateway", "PortMapping", "map_ports", "serves_the_internet"]

#: how long a forward lasts unless renewed (renewed at half of it)
LEASE_S = 3600
#: how long discovery waits for the router's answer, in milliseconds
DISCOVER_MS = 800
DESCRIPTION = "swarmgrad"


class Gateway(Protocol):
    """What :func:`map_ports` asks of a router (the ``miniupnpc.UPnP`` object's calls)."""

    lanaddr: str

    def externalipaddress(self) -> str: ...

    def addportmapping(
        self,
        eport: int,
        proto: str,
        host: str,
        iport: int,
        desc: str,
        remote: str,
        lease: int,
    ) -> bool: ...

    def deleteportmapping(self, eport: int, proto: str) -> bool: ...


def discover(delay_ms: int = DISCOVER_MS) -> Gateway | None:
    """The LAN's Internet Gateway Device, or None when none answers within ``delay_ms``."""
    try:
        import miniupnpc
    except ImportError:  # an installation without the binding maps nothing
        logger.info("no UPnP: the miniupnpc package is not installed")
        return None
    upnp = miniupnpc.UPnP()
    upnp.discoverdelay = delay_ms
    try:
        if not upnp.discover():
            return None
        upnp.selectigd()
    except Exception as exc:  # the binding says "No UPnP device discovered" and the like
        logger.info("no UPnP router: %s", exc)
        return None
    gateway: Gateway = upnp
    return gateway


def serves_the_internet(url: str) -> bool:
    """Whether the coordinator at ``url`` is on the Internet (one of its addresses is a
    global one): only then can a forward on the home router help. A coordinator on this
    machine or on the LAN dials the node without one."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname
    if not host:
        return False
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return True  # the join names the problem; a forward costs nothing more
    return any(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_global for info in found)


class PortMapping:
    """Ports the router forwards to this machine: renewed in the background, removed by
    :meth:`close` (idempotent)."""

    def __init__(
        self, gateway: Gateway, external_ip: str, ports: Sequence[int], lease_s: int
    ) -> None:
        self.gateway = gateway
        self.external_ip = external_ip
        self.ports = tuple(ports)
        self.lease_s = lease_s
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._renewer: threading.Thread | None = None
        if lease_s > 0:
            self._renewer = threading.Thread(
                target=self._renew, name="swarmgrad-port-mapping", daemon=True
            )
            self._renewer.start()

    def _renew(self) -> None:
        while not self._closed.wait(self.lease_s / 2):
            with self._lock:
                if self._closed.is_set():
                    return
                for port in self.ports:
                    try:
                        _add(self.gateway, port, self.lease_s)
                    except Exception as exc:
                        logger.warning(
                            "the router did not renew the forward of port %d: %s", port, exc
                        )

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            _remove(self.gateway, self.ports)
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=5)

    def __repr__(self) -> str:
        ports = ", ".join(str(p) for p in self.ports)
        return f"PortMapping({self.external_ip}: {ports})"


def map_ports(
    ports: Sequence[int],
    *,
    gateway: Gateway | None = None,
    lease_s: int = LEASE_S,
    delay_ms: int = DISCOVER_MS,
) -> PortMapping | None:
    """Forward each of ``ports`` (TCP, the same number outside) to this machine; None and
    nothing mapped when the router cannot (see the module). ``gateway``: a router already
    found (default: :func:`discover`)."""
    wanted = [int(p) for p in dict.fromkeys(ports) if p]
    if not wanted:
        return None
    if gateway is None:
        gateway = discover(delay_ms)
        if gateway is None:
            return None
    try:
        external = str(gateway.externalipaddress())
        address = ipaddress.ip_address(external)
    except Exception as exc:
        logger.info("the UPnP router gives no public address: %s", exc)
        return None
    if not address.is_global:
        logger.info("the UPnP router's own address %s is not public: not mapping", external)
        return None
    done: list[int] = []
    for port in wanted:
        try:
            lease = _add(gateway, port, lease_s)
        except Exception as exc:  # e.g. 718 ConflictInMappingEntry: another machine's
            logger.info("the UPnP router did not forward port %d: %s", port, exc)
            _remove(gateway, done)
            return None
        lease_s = lease
        done.append(port)
    logger.info("the router forwards TCP ports %s from %s", ", ".join(map(str, done)), external)
    return PortMapping(gateway, external, done, lease_s)


def _add(gateway: Gateway, port: int, lease_s: int) -> int:
    """Forward ``port``; the lease it got (0: a router that only keeps forwards for good,
    which are then removed on close all the same)."""
    try:
        ok = gateway.addportmapping(port, "TCP", gateway.lanaddr, port, DESCRIPTION, "", lease_s)
    except Exception as exc:
        only_permanent = "725" in str(exc) or "Permanent" in str(exc)
        if lease_s == 0 or not only_permanent:
            raise
        ok, lease_s = (
            gateway.addportmapping(port, "TCP", gateway.lanaddr, port, DESCRIPTION, "", 0),
            0,
        )
    if not ok:
        raise OSError(f"the router refused to forward port {port}")
    return lease_s


def _remove(gateway: Gateway, ports: Sequence[int]) -> None:
    for port in ports:
        try:
            gateway.deleteportmapping(port, "TCP")
        except Exception as exc:
            logger.info("the router did not remove the forward of port %d: %s", port, exc)
