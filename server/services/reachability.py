"""Can other peers connect to this one? The coordinator tries, from the outside.

A volunteer behind a NAT or a firewall cannot tell by itself whether its listening ports are
reachable. After joining, it asks the coordinator, which opens TCP connections to the address
it sees the request come from (the client address; behind a reverse proxy, the one uvicorn
takes from the proxy headers) on the peer's ports, concurrently and with a short timeout.
The peer's announced addresses follow the answer: ``ws://host:port`` when every port
answered; none, and client mode, otherwise. Bootstrap hands out only reachable peers.

Probes cost the coordinator a connection attempt each, to a host the caller does not choose,
so a peer may ask once per ``reachability_interval_s``; the time of the last probe is a
column of the peer, claimed by a conditional update, so the limit holds across workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
from dataclasses import dataclass

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from server.clock import now_ms
from server.exceptions import RateLimited
from server.models import Peer


@dataclass(frozen=True, slots=True)
class Reachability:
    reachable: bool
    address: str | None
    host: str
    port: int
    bulk_port: int | None
    detail: str


async def check(
    session: Session,
    peer_pk: int,
    host: str | None,
    port: int,
    bulk_port: int | None,
    *,
    interval_s: float,
    timeout_s: float,
) -> Reachability:
    """Probe the peer's ports from here and record the outcome (see the module's docstring);
    :class:`RateLimited` when the peer was probed less than ``interval_s`` ago."""
    await asyncio.to_thread(_claim, session, peer_pk, interval_s)
    ip = _ip_address(host)
    ports = [port] if bulk_port is None else [port, bulk_port]
    if ip is None:
        failures = [f"its address {host!r} is not an IP address the coordinator can probe"]
    else:
        outcomes = await asyncio.gather(*(_probe(ip, p, timeout_s) for p in ports))
        failures = [
            f"port {p} {outcome}" for p, outcome in zip(ports, outcomes, strict=True) if outcome
        ]
    shown = host or "unknown"
    if failures or ip is None:
        address = None
        detail = (
            f"not reachable from outside at {shown}: {'; '.join(failures)}. Forward the "
            "port(s) to this machine to serve other peers; meanwhile it runs in client mode"
        )
    else:
        address = f"ws://{_host_in_url(ip)}:{port}"
        detail = f"reachable at {address}" + (
            f" (bulk port {bulk_port} too)" if bulk_port is not None else ""
        )
    await asyncio.to_thread(_record, session, peer_pk, address)
    return Reachability(
        reachable=address is not None,
        address=address,
        host=shown if ip is None else str(ip),
        port=port,
        bulk_port=bulk_port,
        detail=detail,
    )


def _claim(session: Session, peer_pk: int, interval_s: float) -> None:
    now = now_ms()
    interval_ms = int(interval_s * 1000)
    claimed = session.execute(
        update(Peer)
        .where(
            Peer.id == peer_pk,
            or_(Peer.last_probe_ms.is_(None), Peer.last_probe_ms <= now - interval_ms),
        )
        .values(last_probe_ms=now)
        .execution_options(synchronize_session=False)
    )
    if claimed.rowcount == 1:  # type: ignore[attr-defined]
        session.commit()  # before probing: other workers must see the claim at once
        return
    last = session.scalar(select(Peer.last_probe_ms).where(Peer.id == peer_pk)) or now
    session.rollback()
    wait_s = max(0.0, (last + interval_ms - now) / 1000)
    raise RateLimited(
        f"this peer's ports were probed less than {interval_s:g} s ago; "
        f"try again in {max(1, round(wait_s))} s",
        retry_after_s=wait_s,
    )


def _record(session: Session, peer_pk: int, address: str | None) -> None:
    session.execute(
        update(Peer)
        .where(Peer.id == peer_pk)
        .values(addresses=[address] if address else [], client_mode=address is None)
        .execution_options(synchronize_session=False)
    )
    session.commit()


def _ip_address(host: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not host:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    # A dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d.
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _host_in_url(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    return f"[{ip}]" if ip.version == 6 else str(ip)


async def _probe(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, timeout_s: float
) -> str | None:
    """``None`` when a TCP connection to ``ip:port`` opens within ``timeout_s``; otherwise
    what happened, in a few words."""
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(str(ip), port)
    except TimeoutError:
        return f"did not answer within {timeout_s:g} s"
    except OSError as exc:
        # asyncio's strerror names the address; the errno's text is the short reason.
        reason = os.strerror(exc.errno) if exc.errno else type(exc).__name__
        return reason.lower()
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None
