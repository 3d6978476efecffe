"""Connections that never send a request, against a real ``swarmgrad coordinator`` process.

uvicorn arms its keep-alive timer only after a response: a socket that sends nothing, or
its headers a byte at a time, stays open for ever, and every one holds a descriptor of the
coordinator. Guards :mod:`server.http_guard` as ``swarmgrad coordinator`` runs it: the header
deadline (``http_header_timeout_s``; without it, no idle connection below is ever closed),
the cap per source (``http_max_pending_per_source``) and the cap per worker
(``http_max_connections``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from swarmlab.node_process import wait_until
from tests.attacks.conftest import Attack, Coordinator, CoordinatorFactory
from tests.conftest import scaled

pytestmark = pytest.mark.slow


def descriptors(coordinator: Coordinator) -> int:
    """Open file descriptors of the coordinator process."""
    process = coordinator.process.process
    assert process is not None
    return len(os.listdir(f"/proc/{process.pid}/fd"))


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@contextlib.contextmanager
def idle_connections(
    coordinator: Coordinator, count: int, source: str = "127.0.0.1"
) -> Iterator[list[socket.socket]]:
    """``count`` TCP connections from ``source`` that send nothing."""
    host, port = coordinator.process.host, coordinator.process.port
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection((host, port), source_address=(source, 0))
            sock.setblocking(False)
            sockets.append(sock)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def healthy(coordinator: Coordinator, source: str = "127.0.0.1") -> bool:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(base_url=coordinator.url, transport=transport, timeout=10.0) as client:
        return client.get("/healthz").status_code == 200


def test_idle_connections_are_closed(attack: Attack, start_coordinator: CoordinatorFactory) -> None:
    """Idle connections that never send a request, each holding a descriptor"""
    timeout_s = 1.0
    coordinator = start_coordinator(
        SWARMGRAD_HTTP_HEADER_TIMEOUT_S=str(timeout_s),
        # Every idle connection below is let in, so that only the deadline closes them.
        SWARMGRAD_HTTP_MAX_PENDING_PER_SOURCE="1000",
    )
    baseline = descriptors(coordinator)
    with idle_connections(coordinator, 300) as idle:
        # A slow client: a byte of a request every fifth of the deadline.
        slow = socket.create_connection((coordinator.process.host, coordinator.process.port))
        slow.setblocking(False)
        opened = time.monotonic()
        held = wait_until(lambda: descriptors(coordinator) - baseline >= 300, scaled(10))
        assert held, f"{descriptors(coordinator) - baseline} descriptors for 300 connections"
        assert not any(closed_by_server(s) for s in idle)
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
        sent = 0
        while not closed_by_server(slow) and time.monotonic() - opened < scaled(10):
            with contextlib.suppress(OSError):
                slow.send(request[sent % len(request) : sent % len(request) + 1])
            sent += 1
            time.sleep(timeout_s / 5)  # the slow client's pace, not a wait for a result
        assert closed_by_server(slow), "a client sending its headers slowly was never closed"
        assert wait_until(lambda: all(closed_by_server(s) for s in idle), scaled(10))
        closed_after = time.monotonic() - opened
        slow.close()
    attack.outcome(
        f"300 idle connections and one sending a byte every {timeout_s / 5:g} s closed "
        f"by the coordinator within {closed_after:.1f} s (header deadline {timeout_s:g} s)"
    )
    assert wait_until(lambda: descriptors(coordinator) - baseline <= 5, scaled(10))
    assert healthy(coordinator)
    attack.effect("the coordinator's descriptors back to where they were; requests answered")


def test_idle_connections_are_capped(attack: Attack, start_coordinator: CoordinatorFactory) -> None:
    """Idle connections from one address, and from many, take every descriptor"""
    coordinator = start_coordinator(
        SWARMGRAD_HTTP_HEADER_TIMEOUT_S="60",
        SWARMGRAD_HTTP_MAX_PENDING_PER_SOURCE="8",
        SWARMGRAD_HTTP_MAX_CONNECTIONS="40",
    )
    baseline = descriptors(coordinator)
    # Not 127.0.0.1: loopback is a trusted proxy by default, and proxies are exempt.
    with idle_connections(coordinator, 100, source="127.0.0.3") as idle:
        assert wait_until(lambda: sum(closed_by_server(s) for s in idle) >= 92, scaled(10))
        assert sum(not closed_by_server(s) for s in idle) == 8
        assert descriptors(coordinator) - baseline <= 8 + 2
        # Another address (all of 127/8 is this machine) is let in.
        assert healthy(coordinator, source="127.0.0.2")
        attack.outcome("100 idle connections from one address: 92 closed at once, 8 held")
        # A trusted proxy (loopback, by default) may open many at once.
        with idle_connections(coordinator, 20) as proxied:
            assert wait_until(lambda: descriptors(coordinator) - baseline >= 8 + 20, scaled(10))
            assert not any(closed_by_server(s) for s in proxied)
        sources = [f"127.0.1.{i}" for i in range(1, 8)]
        with contextlib.ExitStack() as stack:
            more = [
                s for a in sources for s in stack.enter_context(idle_connections(coordinator, 8, a))
            ]
            assert wait_until(
                lambda: sum(not closed_by_server(s) for s in [*idle, *more]) <= 40, scaled(10)
            )
            assert descriptors(coordinator) - baseline <= 40 + 2
            attack.outcome(
                f"{len(more) + 8} idle connections from 8 addresses: at most 40 held "
                "(the worker's cap)"
            )
    assert wait_until(lambda: healthy(coordinator), scaled(10))
    attack.effect("other addresses answered while one holds its share; all once they go")


def test_endless_headers_are_cut(attack: Attack, start_coordinator: CoordinatorFactory) -> None:
    """A request whose headers never end, held in the coordinator's memory"""
    coordinator = start_coordinator()
    with socket.create_connection((coordinator.process.host, coordinator.process.port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: ")
        sent = 0
        with contextlib.suppress(OSError):  # reset once the coordinator closed it
            while sent < 16 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
        sock.settimeout(scaled(10))
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(4096):
                answer += chunk
    assert sent < 16 * 1024 * 1024, "16 MiB of one header taken in"
    attack.outcome(f"cut after {sent // 1024} KiB of headers (bound 64 KiB)")
    if answer:  # unless the reset overtook it
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    headers = {f"X-Note-{i}": "n" * 1000 for i in range(20)}  # 20 kB, as a big cookie
    assert coordinator.http.get("/healthz", headers=headers).status_code == 200
    attack.effect("requests with 20 kB of headers answered")
