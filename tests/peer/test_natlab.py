"""The NAT lab's home routers behave as their kinds: mapping, filtering, UDP, port mapping.

Needs root, iproute2, nftables and miniupnpd; skipped elsewhere with the reason, and a
failure under ``CI=true`` (``make test`` installs them).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import swarmlab.natlab as natlab
from swarmlab.natlab import Link, NatLab, RouterKind, sweep, unavailable
from tests.conftest import scaled

REASON = unavailable(list(RouterKind))
if REASON is not None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the NAT lab is needed in CI: {REASON}", pytrace=False)
    pytest.skip(REASON, allow_module_level=True)

PROBE = str(Path(natlab.__file__).with_name("natlab_probe.py"))
OBSERVER = 3478
KINDS = [
    RouterKind.EIM,
    RouterKind.SYMMETRIC,
    RouterKind.UDP_BLOCKED,
    RouterKind.PORT_MAPPING,
    RouterKind.FORWARDED,
]
EIM, SYMMETRIC, UDP_BLOCKED, PORT_MAPPING, FORWARDED = range(5)


@pytest.fixture(scope="module")
def lab() -> Iterator[NatLab]:
    with NatLab(KINDS, publics=2, link=Link(100, 10)) as made:
        observers = [
            subprocess.Popen(
                made.public_command(i, [sys.executable, PROBE, "observe", str(OBSERVER)]),
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        try:
            for observer in observers:
                assert observer.stdout is not None
                assert json.loads(observer.stdout.readline()) == {"ready": True}
            yield made
        finally:
            for observer in observers:
                observer.kill()
                observer.communicate()


def _probe(command: list[str], timeout: float) -> dict[str, object]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + scaled(20))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _from_volunteer(lab: NatLab, k: int, *args: str, timeout: float = 5.0) -> dict[str, object]:
    argv = [sys.executable, PROBE, *args, "--timeout", str(timeout)]
    return _probe(lab.volunteer_command(k, argv), timeout)


def _seen(lab: NatLab, k: int, proto: str, public: int, local: int) -> str:
    answer = _from_volunteer(
        lab, k, proto, lab.public_address(public), str(OBSERVER), "--from", str(local),
        timeout=scaled(5),
    )  # fmt: skip
    assert "seen" in answer, f"volunteer {k} ({lab.kinds[k].value}) over {proto}: {answer}"
    return str(answer["seen"])


def _inbound(lab: NatLab, k: int, port: int, *, udp: bool = False, timeout: float = 2.0) -> str:
    """Listen on the volunteer's ``port`` while public host 1 sends to its router's
    ``port``: "reached" or "dropped" (a refusal would say the router answered)."""
    flag = ["--udp"] if udp else []
    listen_argv = [sys.executable, PROBE, "listen", str(port), *flag, "--timeout", str(timeout)]
    listener = subprocess.Popen(
        lab.volunteer_command(k, listen_argv), stdout=subprocess.PIPE, text=True
    )
    try:
        assert listener.stdout is not None
        assert json.loads(listener.stdout.readline()) == {"ready": True}
        send = [sys.executable, PROBE, "udp" if udp else "tcp", lab.router_address(k), str(port)]
        sent = _probe(lab.public_command(1, [*send, "--timeout", str(timeout)]), timeout)
        out, _ = listener.communicate(timeout=timeout + scaled(20))
        heard = json.loads(out.splitlines()[-1])
        if "from" in heard:
            return "reached"
        assert sent.get("error") != "refused", "a home router drops, it does not refuse"
        return "dropped"
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.communicate()


def test_eim_router_keeps_one_public_port_for_every_destination(lab: NatLab) -> None:
    router = lab.router_address(EIM)
    first = _seen(lab, EIM, "tcp", 0, 40001)
    second = _seen(lab, EIM, "tcp", 1, 40001)
    assert first == second == f"{router}:40001", "masquerade keeps the port, to everyone"
    assert _seen(lab, EIM, "udp", 0, 40002) == _seen(lab, EIM, "udp", 1, 40002)


def test_eim_router_lets_in_only_answers(lab: NatLab) -> None:
    assert _inbound(lab, EIM, 40003) == "dropped"
    assert _inbound(lab, EIM, 40004, udp=True) == "dropped"
    # an answer passes: the volunteer sent to public 0, public 0 replies (the observer)
    assert _seen(lab, EIM, "udp", 0, 40005) == f"{lab.router_address(EIM)}:40005"


def test_symmetric_router_gives_each_connection_a_new_port(lab: NatLab) -> None:
    ports = {
        _seen(lab, SYMMETRIC, proto, public, 40010 + n)
        for n, (proto, public) in enumerate([("tcp", 0), ("tcp", 1)])
    }
    assert len(ports) == 2
    to_zero, to_one = (_seen(lab, SYMMETRIC, "udp", public, 40020) for public in (0, 1))
    assert to_zero != to_one, "one inside port, a different public port per destination"
    assert all(seen.split(":")[0] == lab.router_address(SYMMETRIC) for seen in ports)
    assert _inbound(lab, SYMMETRIC, 40021) == "dropped"


def test_udp_blocked_router_passes_tcp_only(lab: NatLab) -> None:
    assert _seen(lab, UDP_BLOCKED, "tcp", 0, 40030) == f"{lab.router_address(UDP_BLOCKED)}:40030"
    answer = _from_volunteer(lab, UDP_BLOCKED, "udp", lab.public_address(0), str(OBSERVER))
    assert answer == {"error": "timeout"}


def test_forwarded_router_lets_everyone_in(lab: NatLab) -> None:
    assert _inbound(lab, FORWARDED, 40040) == "reached"
    assert _inbound(lab, FORWARDED, 40041, udp=True) == "reached"


def _natpmp(lab: NatLab, request: bytes) -> bytes:
    """One NAT-PMP exchange (RFC 6886) with the port-mapping router, from its volunteer."""
    script = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)\n"
        "s.sendto(bytes.fromhex(sys.argv[2]), (sys.argv[1], 5351))\n"
        "print(s.recvfrom(64)[0].hex())\n"
    )
    gateway = f"192.168.{PORT_MAPPING + 1}.1"
    argv = [sys.executable, "-c", script, gateway, request.hex()]
    done = subprocess.run(
        lab.volunteer_command(PORT_MAPPING, argv),
        capture_output=True,
        text=True,
        timeout=scaled(20),
    )
    assert done.returncode == 0, done.stderr
    return bytes.fromhex(done.stdout.strip())


def test_port_mapping_router_maps_a_port_on_request(lab: NatLab) -> None:
    assert _inbound(lab, PORT_MAPPING, 40050) == "dropped", "nothing is open until asked"
    address = _natpmp(lab, bytes([0, 0]))
    assert address[:4] == bytes([0, 128, 0, 0])
    assert socket.inet_ntoa(address[8:12]) == lab.router_address(PORT_MAPPING)
    # map TCP 40050 -> 40050 for an hour
    answer = _natpmp(lab, struct.pack("!BBHHHI", 0, 2, 0, 40050, 40050, 3600))
    _, op, result, _, inside, outside, lifetime = struct.unpack("!BBHIHHI", answer)
    assert (op, result, inside, outside) == (130, 0, 40050, 40050) and lifetime > 0
    assert _inbound(lab, PORT_MAPPING, 40050) == "reached"
    assert _inbound(lab, PORT_MAPPING, 40051) == "dropped", "only the mapped port"


def test_a_lab_left_by_a_dead_process_is_swept() -> None:
    # a namespace named as a lab of a process that no longer runs
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = natlab._base36(int(child.stdout))
    name = f"sn{dead}_0-v0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in sweep()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert name not in listed
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def test_a_closed_lab_leaves_no_namespace() -> None:
    with NatLab([RouterKind.EIM]) as made:
        names = [made.volunteer_namespace(0), made.router_namespace(0)]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)


def test_a_volunteer_asks_its_router_for_forwards_and_removes_them_when_it_leaves(
    lab: NatLab,
) -> None:
    """peer.transport.port_mapping against the router's real UPnP service (miniupnpd)."""
    script = (
        "import json, sys\n"
        "from peer.transport.port_mapping import map_ports\n"
        "mapping = map_ports([40060])\n"
        "print(json.dumps(mapping and [mapping.external_ip, list(mapping.ports)]), flush=True)\n"
        "sys.stdin.readline()\n"
        "mapping and mapping.close()\n"
        "print('closed', flush=True)\n"
    )
    assert _inbound(lab, PORT_MAPPING, 40060) == "dropped"
    volunteer = subprocess.Popen(
        lab.volunteer_command(PORT_MAPPING, [sys.executable, "-c", script]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert volunteer.stdin is not None and volunteer.stdout is not None
        mapped = json.loads(volunteer.stdout.readline())
        assert mapped == [lab.router_address(PORT_MAPPING), [40060]]
        assert _inbound(lab, PORT_MAPPING, 40060) == "reached"
        out, _ = volunteer.communicate("\n", timeout=scaled(20))
        assert out.strip() == "closed"
    finally:
        if volunteer.poll() is None:
            volunteer.kill()
            volunteer.communicate()
    assert _inbound(lab, PORT_MAPPING, 40060) == "dropped", "the forward is gone"
