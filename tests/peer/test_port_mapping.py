"""Port forwards asked of a home router (UPnP-IGD), against a router of our own: what is
mapped, renewed and removed, and what leaves nothing mapped."""

from __future__ import annotations

import threading

import pytest

from peer.transport import port_mapping
from peer.transport.port_mapping import map_ports, serves_the_internet
from tests.conftest import scaled


class Router:
    """An Internet Gateway Device's port-mapping calls, as miniupnpc makes them."""

    lanaddr = "192.168.1.2"

    def __init__(
        self,
        external: str = "101.77.0.2",
        taken: set[int] = frozenset(),
        permanent_only: bool = False,
    ) -> None:
        self.external = external
        self.taken = set(taken)
        self.permanent_only = permanent_only
        self.mapped: dict[int, tuple[str, int, int]] = {}
        self.adds: list[tuple[int, int]] = []
        self.renewed = threading.Event()

    def externalipaddress(self) -> str:
        return self.external

    def addportmapping(
        self, eport: int, proto: str, host: str, iport: int, desc: str, remote: str, lease: int
    ) -> bool:
        assert proto == "TCP" and desc == "swarmgrad" and remote == ""
        if eport in self.taken:
            raise Exception("ConflictInMappingEntry")  # what the binding raises: 718
        if self.permanent_only and lease:
            raise Exception("OnlyPermanentLeasesSupported")
        if eport in self.mapped:
            self.renewed.set()
        self.adds.append((eport, lease))
        self.mapped[eport] = (host, iport, lease)
        return True

    def deleteportmapping(self, eport: int, proto: str) -> bool:
        del self.mapped[eport]
        return True


def test_each_port_is_forwarded_under_its_own_number_and_removed_on_close() -> None:
    router = Router()
    mapping = map_ports([4000, 4001, 4000, 0], gateway=router)
    assert mapping is not None
    assert mapping.external_ip == "101.77.0.2" and mapping.ports == (4000, 4001)
    assert router.mapped == {4000: ("192.168.1.2", 4000, 3600), 4001: ("192.168.1.2", 4001, 3600)}
    mapping.close()
    mapping.close()  # idempotent
    assert router.mapped == {}


def test_a_port_the_router_refuses_leaves_nothing_mapped() -> None:
    router = Router(taken={4001})  # another machine on the LAN has it
    assert map_ports([4000, 4001], gateway=router) is None
    assert router.adds == [(4000, 3600)] and router.mapped == {}


@pytest.mark.parametrize("external", ["100.64.3.4", "10.0.0.7", "not an address"])
def test_a_router_behind_another_nat_is_not_asked(external: str) -> None:
    """A carrier's NAT (100.64/10) or a second home router in front: a forward here would
    reach no one."""
    router = Router(external=external)
    assert map_ports([4000], gateway=router) is None
    assert router.adds == []


def test_a_router_that_keeps_forwards_only_for_good_gets_them_removed_on_close() -> None:
    router = Router(permanent_only=True)
    mapping = map_ports([4000], gateway=router)
    assert mapping is not None and mapping.lease_s == 0
    assert router.mapped == {4000: ("192.168.1.2", 4000, 0)}
    mapping.close()
    assert router.mapped == {}


def test_forwards_are_renewed_before_their_lease_ends() -> None:
    router = Router()
    mapping = map_ports([4000], gateway=router, lease_s=1)  # renewed every half second
    assert mapping is not None
    try:
        assert router.renewed.wait(scaled(10))
        assert router.mapped == {4000: ("192.168.1.2", 4000, 1)}
    finally:
        mapping.close()
    assert router.mapped == {}


def test_no_router_on_the_lan_maps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(port_mapping, "discover", lambda delay_ms: None)
    assert map_ports([4000]) is None


def test_only_a_coordinator_on_the_internet_is_worth_a_forward() -> None:
    assert serves_the_internet("http://101.77.0.1:8000")
    for local in [
        "http://127.0.0.1:8000",
        "http://192.168.1.4",
        "http://[::1]:80",
        "http://localhost",
    ]:
        assert not serves_the_internet(local), local
