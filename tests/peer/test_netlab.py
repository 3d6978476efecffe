"""The emulated network of the benchmarks: namespaces on a bridge, shaped links, cuts.

Needs root and iproute2; skipped elsewhere with the reason, and a failure under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from swarmlab.netlab import Link, NetLab, NetLabError, home_links, unavailable
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
    import swarmlab.netlab

    real, calls = swarmlab.netlab._run, []

    def failing(argv: list[str]) -> None:
        calls.append(argv)
        if len(calls) == 6:  # after the switch and the first peer's namespace exist
            raise NetLabError("injected")
        real(argv)

    monkeypatch.setattr(swarmlab.netlab, "_run", failing)
    lab = NetLab(2)
    with pytest.raises(NetLabError, match="injected"):
        lab.__enter__()
    assert lab._tag not in _namespaces()


# An echo server at argv[1]:9001 (one byte back for each byte, or "k" once a bulk upload of
# argv[2] bytes has arrived); a client that measures round trips and a bulk upload to it.
ECHO = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], 9001)); s.listen()\n"
    "print('listening', flush=True)\n"
    "c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "while (d := c.recv(1)) == b'p':\n"
    "    c.sendall(d)\n"
    "n, want = len(d), int(sys.argv[2])\n"
    "while n < want:\n"
    "    n += len(c.recv(1 << 20))\n"
    "c.sendall(b'k')\n"
)
PROBE = (
    "import json, socket, sys, time\n"
    "c = socket.create_connection((sys.argv[1], 9001), timeout=60)\n"
    "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "rtts = []\n"
    "for _ in range(12):\n"
    "    t = time.perf_counter(); c.sendall(b'p'); c.recv(1)\n"
    "    rtts.append(time.perf_counter() - t)\n"
    "size, block = int(sys.argv[2]), b'b' * (1 << 16)\n"
    "t = time.perf_counter(); sent = 0\n"
    "while sent < size:\n"
    "    c.sendall(block); sent += len(block)\n"
    "c.recv(1)\n"
    "print(json.dumps({'rtts': rtts, 'mbit': sent * 8e-6 / (time.perf_counter() - t)}))\n"
)


def _probe(lab: NetLab, src: int, dst: int, size: int) -> tuple[float, float, float]:
    """(fastest round trip, median round trip) in ms and the upload rate in Mbit/s from
    peer ``src`` to peer ``dst``, over TCP."""
    server = subprocess.Popen(
        lab.command(dst, [sys.executable, "-c", ECHO, lab.address(dst), str(size)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        client = subprocess.run(
            lab.command(src, [sys.executable, "-c", PROBE, lab.address(dst), str(size)]),
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
        assert client.returncode == 0, client.stderr
        found = json.loads(client.stdout)
    finally:
        server.kill()
        server.communicate()
    rtts = sorted(1e3 * r for r in found["rtts"][2:])  # the first exchanges warm up
    return rtts[0], rtts[len(rtts) // 2], found["mbit"]


def test_links_delay_each_round_trip_by_the_mean_of_both_peers_links() -> None:
    with NetLab(3, links=[Link(None, 20), Link(None, 100), Link(None, 60)]) as lab:
        lab.shape(50)  # the links keep their delays
        for (src, dst), expected in (((0, 1), 60), ((2, 0), 40), ((1, 2), 80)):
            fastest, median, mbit = _probe(lab, src, dst, 1 << 20)
            assert mbit <= 1.1 * 50, (src, dst, mbit)
            # a delay line never delivers early; the machine's load only adds to it
            assert fastest >= 0.95 * expected, (src, dst, fastest)
            assert median <= expected + 1e3 * scaled(0.03), (src, dst, median)
        delays = list(lab._delays)
        assert all(process.poll() is None for process in delays)
    assert all(process.poll() is not None for process in delays), "the delay lines stopped"


def test_each_peer_sends_and_receives_at_its_own_links_rate() -> None:
    # rates alone (the kernel's token buckets): a delay line is a process, which a loaded
    # machine slows down; the delayed links' rates are bounded in the test above
    with NetLab(3, links=[Link(15), Link(60), Link(60)]) as lab:
        _, _, to_slow = _probe(lab, 1, 0, 2 << 20)  # peer 0 downloads at 15 Mbit/s
        _, _, from_slow = _probe(lab, 0, 2, 2 << 20)  # and uploads at 15
        _, _, fast = _probe(lab, 1, 2, 8 << 20)
    # the token bucket's burst (64 KiB) is a few per cent of these transfers
    assert to_slow <= 1.1 * 15 and from_slow <= 1.1 * 15, (to_slow, from_slow)
    assert fast <= 1.1 * 60, fast
    assert fast / max(to_slow, from_slow) >= 2.0, (fast, to_slow, from_slow)


def test_home_links_are_a_reproducible_mix_within_the_ranges() -> None:
    mix = home_links(20, seed=3)
    assert mix == home_links(20, seed=3) and mix != home_links(20, seed=4)
    assert all(20 <= link.rate_mbit <= 200 and 10 <= link.rtt_ms <= 150 for link in mix)  # type: ignore[operator]
    assert max(link.rtt_ms for link in mix) / min(link.rtt_ms for link in mix) > 2
    with pytest.raises(ValueError, match="range"):
        home_links(2, rtt_ms=(50, 10))
    with pytest.raises(ValueError, match="rtt_ms"):
        Link(50, -1)
    with pytest.raises(ValueError, match="rate_mbit"):
        Link(0, 10)
    with pytest.raises(ValueError, match="one Link per peer"):
        NetLab(3, links=[Link(50, 10)])
    with pytest.raises(ValueError, match="either links"):
        NetLab(1, links=[Link(50, 10)], rate_mbit=50)
