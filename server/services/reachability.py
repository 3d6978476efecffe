"""Can other peers connect to this one? The coordinator tries, from the outside.

After joining, a volunteer asks; the coordinator opens TCP connections, concurrently and
with a short timeout, to the peer's ports at the address the request came from. The peer's
announced addresses follow: ``ws://host:port`` when every port answered; otherwise, for a
peer that punches through its NAT, ``punch://host:port/<peer id>``, with the coordinator as
its rendezvous (:func:`rendezvous_peers`); otherwise none, and client mode. Bootstrap hands
out only dialable addresses.

The host of a punch is always the one the coordinator saw; only the port is the peer's
word. A peer may ask once per ``reachability_interval_s`` (claimed by a conditional update
of the peer's row, so the limit holds across workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import urllib.parse

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from server.clock import now_ms
from server.exceptions import RateLimited
from server.models import Peer
from server.schemas import ReachabilityPublic
from server.services import presence


async def check(
    session: Session,
    peer_pk: int,
    host: str | None,
    port: int,
    bulk_port: int | None,
    *,
    interval_s: float,
    timeout_s: float,
    punch_port: int | None = None,
) -> ReachabilityPublic:
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
    punch_address = None
    if (failures or ip is None) and ip is not None and punch_port is not None:
        peer_id = await asyncio.to_thread(_peer_id, session, peer_pk)
        punch_address = f"punch://{_host_in_url(ip)}:{punch_port}/{peer_id}"
        address = None
        detail = (
            f"not reachable from outside at {shown}: {'; '.join(failures)}. Other peers "
            f"behind NATs punch through to it at {ip}:{punch_port}; forwarding the port(s) "
            "to this machine would let every peer reach it"
        )
    elif failures or ip is None:
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
    await asyncio.to_thread(_record, session, peer_pk, address or punch_address)
    return ReachabilityPublic(
        reachable=address is not None,
        address=address,
        host=shown if ip is None else str(ip),
        port=port,
        bulk_port=bulk_port,
        detail=detail,
        punch_address=punch_address,
    )


def _peer_id(session: Session, peer_pk: int) -> str:
    return session.scalar(select(Peer.peer_id).where(Peer.id == peer_pk)) or ""


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
    # Session.execute is typed Result; an UPDATE's is a CursorResult, with rowcount.
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


def rendezvous_peers(
    session: Session, run_id: str, *, exclude: int, online_since_ms: int, limit: int
) -> list[tuple[str, str, int]]:
    """The run's peers seen since ``online_since_ms`` that punch through their NATs, as
    ``(peer id, host, port)``: the host as the coordinator saw it (never the caller, at
    most ``limit``, the most recently seen first)."""
    query = (
        select(Peer)
        .where(
            Peer.run_id == run_id,
            Peer.id != exclude,
            presence.online(online_since_ms),
            Peer.client_mode.is_(False),
        )
        .order_by(Peer.last_seen_ms.desc())
        .limit(limit * 4)  # the reachable ones are skipped below
    )
    found = []
    for peer in session.scalars(query):
        for address in peer.addresses or ():
            parsed = _parse_punch(address)
            if parsed is not None and parsed[2] == peer.peer_id:
                found.append((peer.peer_id, parsed[0], parsed[1]))
                break
        if len(found) >= limit:
            break
    return found


def _parse_punch(address: str) -> tuple[str, int, str] | None:
    parts = urllib.parse.urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "punch" or not parts.hostname or port is None:
        return None
    return parts.hostname, port, parts.path.lstrip("/")


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
