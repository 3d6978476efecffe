"""The emulated network of the benchmarks: namespaces on a bridge, shaped links, cuts.

Needs root and iproute2; skipped elsewhere with the reason, and a failure under ``CI=true``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from peer.netlab import NetLab, NetLabError, unavailable
from tests.conftest import scaled

REASON = unavailable()
if REASON is not None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the network lab is needed in CI: {REASON}", pytrace=False)
    pytest.skip(REASON, allow_module_level=True)


@pytest.fixture
def lab() -> Iterator[NetLab]:
    with NetLab(3) as made:
        yield made


# A listener at argv[1]:9000 that greets one client; a client that connects to it from
# another namespace and prints "ok", or "unreachable" once it gives up.
LISTEN = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], 9000)); s.listen()\n"
    "print('listening', flush=True)\n"
    "c, _ = s.accept(); c.sendall(b'hi'); c.close()\n"
)
CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    c = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[2]))\n"
    "    print('ok' if c.recv(2) == b'hi' else 'garbled')\n"
    "except OSError:\n"
    "    print('unreachable')\n"
)


def _reach(lab: NetLab, src: int, dst: int, timeout: float) -> str:
    server = subprocess.Popen(
        lab.command(dst, [sys.executable, "-c", LISTEN, lab.address(dst)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        client = subprocess.run(
            lab.command(src, [sys.executable, "-c", CONNECT, lab.address(dst), str(timeout)]),
            capture_output=True,
            text=True,
            timeout=timeout + scaled(30),
        )
        return client.stdout.strip()
    finally:
        server.kill()
        server.communicate()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_peers_reach_each_other_and_a_cut_peer_is_unreachable(lab: NetLab) -> None:
    assert _reach(lab, 1, 0, scaled(10)) == "ok"
    assert _reach(lab, 2, 1, scaled(10)) == "ok"
    lab.cut(0)
    assert _reach(lab, 1, 0, 1.0) == "unreachable"
    assert _reach(lab, 2, 1, scaled(10)) == "ok", "the others still reach each other"
    lab.restore(0)
    assert _reach(lab, 1, 0, scaled(10)) == "ok"


def test_a_partition_splits_the_lab_in_sides_until_healed(lab: NetLab) -> None:
    lab.partition([0, 1], [2])
    assert _reach(lab, 1, 0, scaled(10)) == "ok", "a side keeps its own links"
    assert _reach(lab, 2, 0, 1.0) == "unreachable"
    assert _reach(lab, 0, 2, 1.0) == "unreachable"
    lab.partition([0], [1, 2])  # a new split replaces the old one
    assert _reach(lab, 2, 1, scaled(10)) == "ok"
    assert _reach(lab, 1, 0, 1.0) == "unreachable"
    lab.heal()
    assert _reach(lab, 2, 0, scaled(10)) == "ok"
    assert _reach(lab, 0, 1, scaled(10)) == "ok"
    lab.heal()  # whole already: nothing to do
    with pytest.raises(ValueError, match="exactly one"):
        lab.partition([0, 1], [1, 2])
    with pytest.raises(ValueError, match="exactly one"):
        lab.partition([0, 1, 2])
    with pytest.raises(ValueError, match="exactly one"):
        lab.partition([0], [2])


def test_shape_puts_a_token_bucket_on_both_ends_of_every_link(lab: NetLab) -> None:
    lab.shape(50)

    def qdiscs(i: int) -> str:
        return subprocess.run(
            ["tc", "-n", lab.namespace(i), "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout

    assert all("tbf" in qdiscs(i) and "50Mbit" in qdiscs(i) for i in range(3)), qdiscs(0)
    lab.shape(None)
    assert all("tbf" not in qdiscs(i) for i in range(3))
    assert _reach(lab, 0, 2, scaled(10)) == "ok"


def test_the_machine_keeps_nothing_of_a_closed_lab() -> None:
    with NetLab(2, rate_mbit=10) as lab:
        names = [lab.namespace(0), lab.namespace(1)]
        assert all(name in _namespaces() for name in names)
    assert not any(name in _namespaces() for name in names)
    assert "10.77.0." not in subprocess.run(["ip", "addr"], capture_output=True, text=True).stdout


def test_bad_arguments_and_failures_are_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="1 to 250"):
        NetLab(0)
    with pytest.raises(ValueError, match="positive"):
        NetLab(2, rate_mbit=0)
    lab = NetLab(2)
    with pytest.raises(IndexError, match="not in this lab"):
        lab.address(2)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert unavailable() == "network namespaces and tc need root"
    with pytest.raises(NetLabError, match="need root"):
        lab.__enter__()


def test_a_lab_that_fails_half_way_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    import peer.netlab

    real, calls = peer.netlab._run, []

    def failing(argv: list[str]) -> None:
        calls.append(argv)
        if len(calls) == 6:  # after the switch and the first peer's namespace exist
            raise NetLabError("injected")
        real(argv)

    monkeypatch.setattr(peer.netlab, "_run", failing)
    lab = NetLab(2)
    with pytest.raises(NetLabError, match="injected"):
        lab.__enter__()
    assert lab._tag not in _namespaces()
