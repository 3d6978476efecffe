"""TCP hole punching: the role rule, the failure it reports, and in the NAT lab which pairs of
home routers a simultaneous open gets through (needs root and nftables for that part)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from peer import Node
from peer.exceptions import TransportError
from peer.formats.identity import Identity
from peer.node.punching import PunchSchedule
from peer.transport.punch import (
    PunchEndpoint,
    PunchFailed,
    PunchPort,
    dials_first,
    parse_punch_address,
    simultaneous_open,
)
from swarmlab.natlab import Link, NatLab, RouterKind, unavailable
from tests.conftest import scaled

ROOT = Path(__file__).resolve().parents[2]


def test_one_side_dials_first_and_both_agree() -> None:
    a, b = "a" * 32, "b" * 32
    assert dials_first(a, b) and not dials_first(b, a)
    with pytest.raises(ValueError, match="itself"):
        dials_first(a, a)


def test_a_punch_nobody_answers_fails_with_what_was_seen() -> None:
    async def attempt() -> None:
        port, closed = PunchPort(host="127.0.0.1"), PunchPort(host="127.0.0.1")
        try:
            # loopback answers a SYN to a port without a listener with a reset at once
            await simultaneous_open(port, "127.0.0.1", closed.port, timeout=0.5)
        finally:
            port.close()
            closed.close()

    with pytest.raises(PunchFailed, match=r"in 0.5 s \(reset by the other side\)"):
        asyncio.run(attempt())


def test_a_punch_port_is_reserved_until_closed() -> None:
    port = PunchPort(host="127.0.0.1")
    sock = port.socket()
    assert sock.getsockname()[1] == port.port
    sock.close()
    port.close()
    with pytest.raises(PunchFailed, match="closed"):
        port.socket()


# In a volunteer's namespace: reserve a punch port, say it, read the other's public endpoint
# on stdin, punch, and swap names over the connection.
PUNCHER = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
from peer.transport.punch import PunchFailed, PunchPort, simultaneous_open

async def main():
    port = PunchPort()
    print(json.dumps({"port": port.port}), flush=True)
    host, remote = sys.stdin.readline().split()
    try:
        sock = await simultaneous_open(port, host, int(remote), timeout=float(sys.argv[3]))
    except PunchFailed as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, sys.argv[2].encode() + b"\\n")
    heard = (await asyncio.wait_for(loop.sock_recv(sock, 64), 10)).decode().strip()
    print(json.dumps({"heard": heard}), flush=True)
    sock.close()

asyncio.run(main())
"""


def _punch_pair(lab: NatLab, a: int, b: int, timeout: float) -> str:
    """Volunteers ``a`` and ``b`` punch toward each other's router at the port each punches
    from (what a coordinator that saw their addresses would give them): "direct" or why
    not."""
    workers = [
        subprocess.Popen(
            lab.volunteer_command(
                k, [sys.executable, "-c", PUNCHER, str(ROOT), f"v{k}", str(timeout)]
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in (a, b)
    ]
    try:
        ports = []
        for worker in workers:
            assert worker.stdout is not None
            ports.append(json.loads(worker.stdout.readline())["port"])
        for worker, k, port in ((workers[0], b, ports[1]), (workers[1], a, ports[0])):
            assert worker.stdin is not None
            worker.stdin.write(f"{lab.router_address(k)} {port}\n")
            worker.stdin.flush()
        results = []
        for worker in workers:
            out, err = worker.communicate(timeout=timeout + scaled(30))
            assert worker.returncode == 0, err
            results.append(json.loads(out.splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    if results == [{"heard": f"v{b}"}, {"heard": f"v{a}"}]:
        return "direct"
    return "; ".join(str(r.get("error", r)) for r in results)


KINDS = [
    RouterKind.EIM,
    RouterKind.EIM,
    RouterKind.SYMMETRIC,
    RouterKind.UDP_BLOCKED,
    RouterKind.PORT_MAPPING,
]


@pytest.mark.slow
def test_which_home_routers_a_simultaneous_open_gets_through() -> None:
    reason = unavailable(KINDS)
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the NAT lab is needed in CI: {reason}", pytrace=False)
        pytest.skip(reason)
    outcomes = {}
    with NatLab(KINDS, link=Link(50, 40)) as lab:
        for a, b in itertools.combinations(range(len(KINDS)), 2):
            symmetric = RouterKind.SYMMETRIC in (KINDS[a], KINDS[b])
            outcome = _punch_pair(lab, a, b, 3.0 if symmetric else scaled(10))
            outcomes[(a, b)] = outcome
            print(f"{KINDS[a].value:>12} - {KINDS[b].value:<12} {outcome}")
    for (a, b), outcome in outcomes.items():
        if RouterKind.SYMMETRIC in (KINDS[a], KINDS[b]):
            assert outcome != "direct", f"{a}-{b}: a symmetric router cannot be punched"
        else:
            # TCP: a router that blocks UDP is punched like any endpoint-independent one
            assert outcome == "direct", f"{KINDS[a].value}-{KINDS[b].value}: {outcome}"


# ----------------------------------------------------------------------- the schedule (no I/O)


def _endpoint(n: int, port: int = 4000) -> PunchEndpoint:
    return PunchEndpoint(f"198.51.100.{n}", port, chr(ord("a") + n) * 32)


def test_introduced_peers_are_due_at_once_and_a_miss_waits_for_the_next_slot() -> None:
    schedule = PunchSchedule(window_s=10, retry_period_s=60, max_parallel=8)
    schedule.introduce([_endpoint(1), _endpoint(2)], now=125.0)
    assert {e.peer_id for e in schedule.due(125.0, lambda peer: False)} == {"b" * 32, "c" * 32}
    assert schedule.due(125.0, lambda peer: False) == [], "in flight: not twice"
    schedule.finished("b" * 32, direct=False, detail="no answer", now=135.0)
    assert schedule.due(179.9, lambda peer: False) == []
    # every peer that missed tries again at the same wall-clock slot
    assert schedule.due(180.0, lambda peer: False) == [_endpoint(1)]
    schedule.finished("c" * 32, direct=True, detail="punched", now=136.0)
    assert schedule.due(200.0, lambda peer: True) == [], "a linked peer is left alone"
    schedule.lost("c" * 32, now=300.0)
    assert schedule.due(300.0, lambda peer: False) == [_endpoint(2)]


def test_the_coordinators_list_decides_where_a_punch_goes() -> None:
    schedule = PunchSchedule()
    schedule.introduce([_endpoint(1)], now=0.0)
    assert schedule.endpoint("b" * 32) == _endpoint(1)
    schedule.introduce([_endpoint(1, port=5000)], now=1.0)  # it moved: due again
    assert schedule.due(1.0, lambda peer: False) == [_endpoint(1, port=5000)]
    schedule.introduce([], now=2.0)
    assert schedule.endpoint("b" * 32) is None
    assert (
        schedule.start("b" * 32, now=2.0)
        == "not introduced by the coordinator: no punching toward it"
    )


def test_a_pool_asking_for_a_peer_that_missed_goes_on_to_its_other_addresses() -> None:
    schedule = PunchSchedule(window_s=10, retry_period_s=60)
    schedule.introduce([_endpoint(1)], now=0.0)
    assert schedule.start("b" * 32, now=0.0) is None
    assert schedule.start("b" * 32, now=1.0) == "a punch toward it is under way"
    schedule.finished("b" * 32, direct=False, detail="no answer", now=10.0)
    assert "the last punch missed (no answer)" in str(schedule.start("b" * 32, now=30.0))
    assert schedule.start("b" * 32, now=60.0) is None, "the next slot: both sides try"


def test_parallel_punches_are_bounded() -> None:
    schedule = PunchSchedule(max_parallel=2)
    schedule.introduce([_endpoint(n) for n in range(1, 6)], now=0.0)
    assert len(schedule.due(0.0, lambda peer: False)) == 2
    assert schedule.due(0.0, lambda peer: False) == []


def test_punch_addresses_name_an_ip_a_port_and_a_peer() -> None:
    endpoint = _endpoint(7)
    assert parse_punch_address(endpoint.address) == endpoint
    for bad in (
        "ws://1.2.3.4:5/x",
        "punch://example.org:5/x",
        "punch://1.2.3.4/x",
        "punch://1.2.3.4:0/x",
    ):
        with pytest.raises(ValueError):
            parse_punch_address(bad)


# ----------------------------------------------------------------------- hostile addresses


def test_a_punch_goes_only_where_the_coordinator_saw_an_introduced_peer() -> None:
    """A member record's punch:// address names a peer, never where to send: a peer the
    coordinator did not introduce is not punched toward at all, and an introduced one is
    punched toward the coordinator's endpoint whatever host the address names."""
    target = PunchPort(host="127.0.0.1")  # bound, never listening: answers with resets
    other = Identity()
    with Node(punch_port=0, request_timeout=1.0) as node:
        stranger = f"punch://203.0.113.9:4000/{Identity().peer_id}"
        with pytest.raises(TransportError, match="not introduced by the coordinator"):
            node.run_coroutine(node.core.pool.connect(stranger, None))
        node.introduce([PunchEndpoint("127.0.0.1", target.port, other.peer_id)])
        node.core.puncher.schedule.window_s = 0.5  # type: ignore[union-attr]
        node.core.puncher.schedule.introduction_lag_s = 0.0  # type: ignore[union-attr]
        lying = f"punch://203.0.113.9:4000/{other.peer_id}"
        with pytest.raises(TransportError, match=f"127.0.0.1:{target.port}") as failure:
            node.run_coroutine(node.core.pool.connect(lying, other.peer_id))
        assert "203.0.113.9" not in str(failure.value)
        assert not node.punch_outcomes()[other.peer_id].direct
    target.close()


def test_a_node_listening_on_one_address_punches_from_where_the_coordinator_sees_it() -> None:
    """A node given a host listens there, but its requests to the coordinator leave from
    the system's choice of source address, which is the endpoint the coordinator names for
    it: its punches leave from there too (here 127.0.0.1, not the 127.0.0.2 it listens on),
    or the other side's SYNs, sent there, would find nothing."""
    seen: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(scaled(20))
    with Node(host="127.0.0.2", punch_port=0, request_timeout=1.0) as node:
        assert node.punch_port is not None
        node.announce([f"punch://127.0.0.1:{node.punch_port}/{node.peer_id}"])
        node.introduce([PunchEndpoint("127.0.0.1", listener.getsockname()[1], "b" * 32)])
        conn, source = listener.accept()  # the punch's SYN, answered as a plain listener
        seen.append(f"{source[0]}:{source[1]}")
        conn.close()
        assert seen == [f"127.0.0.1:{node.punch_port}"]
    listener.close()


# ----------------------------------------------------------------------- nodes in the NAT lab

# A node in a volunteer's namespace: say its id and punch port, read its own public endpoint
# and the other's on stdin, announce the one and punch toward the other, then swap values
# through the gossip store over the punched link; stay until told on stdin.
NODE = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from peer import Node, SwarmKeyAuth
from peer.transport.punch import PunchEndpoint

node = Node(host="0.0.0.0", port=0, punch_port=0, auth=SwarmKeyAuth(b"k" * 32))
print(json.dumps({"peer_id": node.peer_id, "port": node.punch_port}), flush=True)
own, other = (PunchEndpoint(**json.loads(sys.stdin.readline())) for _ in range(2))
node.announce([own.address])
node.introduce([other])
deadline = time.monotonic() + float(sys.argv[2])
while node.num_links == 0 and time.monotonic() < deadline:
    time.sleep(0.1)
node.store("hello", node.peer_id, node.get_time() + 60, subkey=node.peer_id)
heard = None
while heard is None and time.monotonic() < deadline:
    found = node.get("hello")
    if found is not None and other.peer_id in found.value:
        heard = found.value[other.peer_id].value
    time.sleep(0.1)
links = [link.conn.remote_address for link in node.core.pool.open_links()]
print(json.dumps({"links": links, "heard": heard}), flush=True)
sys.stdin.readline()  # the other may still be listening for this one's value
node.shutdown()
"""


@pytest.mark.slow
def test_two_nodes_behind_home_routers_link_directly_and_gossip() -> None:
    kinds = [RouterKind.EIM, RouterKind.PORT_MAPPING]
    reason = unavailable(kinds)
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the NAT lab is needed in CI: {reason}", pytrace=False)
        pytest.skip(reason)
    timeout = scaled(30)
    with NatLab(kinds, link=Link(50, 40)) as lab:
        workers = [
            subprocess.Popen(
                lab.volunteer_command(k, [sys.executable, "-c", NODE, str(ROOT), str(timeout)]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(2)
        ]
        try:
            hellos = []
            for worker in workers:
                assert worker.stdout is not None
                hellos.append(json.loads(worker.stdout.readline()))
            endpoints = [
                {"host": lab.router_address(k), "port": h["port"], "peer_id": h["peer_id"]}
                for k, h in enumerate(hellos)
            ]
            for k, worker in enumerate(workers):
                assert worker.stdin is not None
                worker.stdin.write(
                    json.dumps(endpoints[k]) + "\n" + json.dumps(endpoints[1 - k]) + "\n"
                )
                worker.stdin.flush()
            results = []
            for worker in workers:
                assert worker.stdout is not None
                line = worker.stdout.readline()
                assert line, worker.communicate()[1][-3000:]
                results.append(json.loads(line))
            for worker in workers:
                _, err = worker.communicate("bye\n", timeout=scaled(30))
                assert worker.returncode == 0, err[-3000:]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.communicate()
    for k, result in enumerate(results):
        other = endpoints[1 - k]
        assert result["heard"] == other["peer_id"], result
        assert result["links"] == [PunchEndpoint(**other).address], result


def test_a_volunteer_says_how_it_takes_part() -> None:
    from peer.coordinator.joining import path_of
    from peer.volunteer import VolunteerStatus
    from swarmgrad.join import epoch_line

    behind = ["punch://198.51.100.7:4000/" + "a" * 32, "relay://203.0.113.1:4100/" + "a" * 32]
    assert path_of(["ws://198.51.100.7:4000"], {"direct": 0}) == "public"
    assert path_of(["ws://198.51.100.7:4000"], {"direct": 2}, mapped=True) == "mapped"
    assert path_of(behind, {"direct": 1, "punched": 3, "relayed": 1}) == "punched"
    assert path_of(behind, {"direct": 0, "punched": 0, "relayed": 2}) == "relayed"
    assert path_of([], {"direct": 2}) == "dialing out"
    assert path_of(behind, {}) == "unreachable"
    line = epoch_line(VolunteerStatus(epoch=3, samples=10, group_size=6, path="punched"))
    assert line.endswith("| group 6 | path punched | coordinator ok")
