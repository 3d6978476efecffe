"""Home routers on one machine: volunteers behind NATs of the common kinds, and a public side.

Volunteer ``k`` sits alone in a namespace behind its own router (kind: :class:`RouterKind`),
on a home :class:`Link`; the public side is a :class:`~swarmlab.netlab.NetLab`
(:class:`NatLab`'s docstring has the addressing). Needs root, iproute2, ``nft`` (Debian's
``nftables``) and, for ``PORT_MAPPING``, ``miniupnpd``; :func:`unavailable` says what is
missing. Namespaces are named after the process that made them, so a lab left behind by a
crash is removed by the next lab (:func:`sweep`). ::

    with NatLab([RouterKind.EIM, RouterKind.SYMMETRIC], link=Link(50, 50)) as lab:
        server = subprocess.Popen(lab.public_command(0, ["python", "serve.py"]))
        client = subprocess.Popen(lab.volunteer_command(1, ["python", "dial.py",
                                                            lab.public_address(0)]))
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from swarmlab.netlab import (
    Link,
    NetLab,
    NetLabError,
    shape_device,
    start_delay_line,
    stop_delay_line,
)
from swarmlab.netlab import unavailable as netlab_unavailable

__all__ = ["Link", "NatLab", "NetLabError", "RouterKind", "sweep", "unavailable"]


class RouterKind(enum.Enum):
    """How a home router maps and filters.

    Every router masquerades what leaves by its WAN interface (nftables) and lets in from the
    WAN only what answers a connection from inside, as a home router does; the kinds differ
    (:class:`RouterKind`):

    * ``EIM`` -- endpoint-independent mapping with address-and-port-dependent filtering: one
      inside port goes out as the same public port (masquerade keeps the port where it is
      free) to every destination, and a packet from outside passes only if it answers what
      went out to exactly that address and port. Most home routers; TCP simultaneous open and
      UDP hole punching get through.
    * ``SYMMETRIC`` -- a fresh random public port for every connection (``masquerade
      random``): what one peer saw cannot be punched by another. Some CGNATs and corporate
      firewalls.
    * ``UDP_BLOCKED`` -- ``EIM`` for TCP, no UDP out at all.
    * ``PORT_MAPPING`` -- ``EIM`` plus a UPnP-IGD and NAT-PMP/PCP service on the LAN (Debian's
      ``miniupnpd`` with its nftables backend): the volunteer can ask for a port forward.
    * ``FORWARDED`` -- ``EIM`` with every port forwarded to the volunteer (what a user's
      manual port forward or DMZ setting does): the volunteer is reachable at the router's
      address. The "plain router" a benchmark compares with.
    """

    EIM = "eim"
    SYMMETRIC = "symmetric"
    UDP_BLOCKED = "udp-blocked"
    PORT_MAPPING = "port-mapping"
    FORWARDED = "forwarded"


_TAG = re.compile(r"^sn([0-9a-z]+)_[0-9a-z]")
_labs = itertools.count()
WAN, LAN = "eth0", "lan0"
# The public side's addresses: routable ones (a port-mapping router refuses to map on a
# private or reserved WAN address, as it should), which never leave the lab's namespaces.
INTERNET = "101.77.0"


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def unavailable(kinds: Sequence[RouterKind] = ()) -> str | None:
    """Why a NAT lab with routers of ``kinds`` cannot be made here, in one line; None if it
    can."""
    reason = netlab_unavailable()
    if reason is not None:
        return reason
    if shutil.which("nft") is None:
        return "nft not found: install nftables (apt-get install nftables)"
    if RouterKind.PORT_MAPPING in kinds and shutil.which("miniupnpd") is None:
        return "miniupnpd not found: install miniupnpd-nftables"
    return None


def _run(argv: Sequence[str], *, stdin: str | None = None) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, input=stdin)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        raise NetLabError(f"{' '.join(argv)}: {detail or f'exit {done.returncode}'}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Remove what NAT labs of processes that no longer run left behind (their processes,
    namespaces and stray interfaces); returns the namespaces removed."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _TAG.match(name)
        if match is None or _alive(int(match.group(1), 36)):
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        removed.append(name)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        fields = line.split(": ")
        device = fields[1].split("@")[0] if len(fields) > 1 else ""
        match = _TAG.match(device)
        if match is not None and not _alive(int(match.group(1), 36)):
            subprocess.run(["ip", "link", "del", device], capture_output=True, check=False)
    return removed


def ruleset(kind: RouterKind, volunteer: str) -> str:
    """The router's nftables ruleset for ``kind`` (``volunteer``: the LAN host's address)."""
    upnp = kind is RouterKind.PORT_MAPPING
    forward = [
        "jump miniupnpd" if upnp else "",
        f'iifname "{LAN}" oifname "{WAN}" meta l4proto udp drop'
        if kind is RouterKind.UDP_BLOCKED
        else "",
        f'iifname "{LAN}" oifname "{WAN}" accept',
        f'iifname "{WAN}" oifname "{LAN}" ct state established,related accept',
        # a forwarded port (by hand, or mapped by miniupnpd) is a destination NAT
        f'iifname "{WAN}" oifname "{LAN}" ct status dnat accept',
    ]
    prerouting = ["jump prerouting_miniupnpd" if upnp else ""]
    if kind is RouterKind.FORWARDED:
        prerouting.append(f'iifname "{WAN}" meta l4proto {{ tcp, udp }} dnat ip to {volunteer}')
    masquerade = "masquerade random" if kind is RouterKind.SYMMETRIC else "masquerade"
    postrouting = ["jump postrouting_miniupnpd" if upnp else "", f'oifname "{WAN}" {masquerade}']

    def chain(name: str, hook: str, rules: list[str]) -> str:
        body = "".join(f"    {rule}\n" for rule in rules if rule)
        return f"  chain {name} {{\n    {hook}\n{body}  }}\n"

    return (
        "table inet filter {\n"
        + chain(
            "input",
            "type filter hook input priority 0; policy drop;",
            ['iif "lo" accept', f'iifname "{LAN}" accept', "ct state established,related accept"],
        )
        + chain("forward", "type filter hook forward priority 0; policy drop;", forward)
        + chain("prerouting", "type nat hook prerouting priority -100; policy accept;", prerouting)
        + chain(
            "postrouting", "type nat hook postrouting priority 100; policy accept;", postrouting
        )
        + "  chain miniupnpd {\n  }\n"
        + "  chain prerouting_miniupnpd {\n  }\n"
        + "  chain postrouting_miniupnpd {\n  }\n"
        + "}\n"
    )


class NatLab:
    """Public hosts and volunteers behind routers of ``kinds`` (one router per volunteer);
    a context manager that removes it all. ``link`` (or ``links``, one per volunteer) is
    each volunteer's home link.

    The public side is a :class:`~swarmlab.netlab.NetLab` (the "internet": ``101.77.0.0/24``
    on one bridge, addresses that never leave the lab's namespaces): ``publics`` hosts first (a coordinator, a relay), then one router per
    volunteer, whose ``eth0`` is its WAN interface. Volunteer ``k`` has a namespace of its
    own with one interface, ``eth0`` at ``192.168.<k+1>.2``, wired to its router's ``lan0``
    (``192.168.<k+1>.1``, the volunteer's default route). Its home link (:class:`Link`: rate
    each way, round trip) is on that wire, as in :mod:`swarmlab.netlab`: the rate on both ends,
    the delay on what the volunteer sends.
    """

    def __init__(
        self,
        kinds: Sequence[RouterKind],
        *,
        publics: int = 1,
        link: Link | None = None,
        links: Sequence[Link] | None = None,
    ) -> None:
        kinds = [RouterKind(kind) for kind in kinds]
        if not 1 <= len(kinds) <= 200:
            raise ValueError("a NAT lab has 1 to 200 volunteers")
        if not 1 <= publics <= 50:
            raise ValueError("a NAT lab has 1 to 50 public hosts")
        if links is not None and (link is not None or len(links) != len(kinds)):
            raise ValueError(f"give either link or links (one per volunteer: {len(kinds)})")
        self.kinds = kinds
        self.publics = publics
        self.links = list(links) if links is not None else [link or Link()] * len(kinds)
        self._tag = f"sn{_base36(os.getpid())}_{_base36(next(_labs) % 36)}"
        self.internet = NetLab(publics + len(kinds), tag=self._tag, subnet=INTERNET)
        self._created: list[str] = []
        self._processes: list[subprocess.Popen[str]] = []
        self._delays: list[subprocess.Popen[str]] = []
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    # ----------------------------------------------------------------- names and commands

    def _check(self, k: int) -> None:
        if not 0 <= k < len(self.kinds):
            raise IndexError(f"volunteer {k} is not in this lab of {len(self.kinds)}")

    def public_address(self, i: int) -> str:
        if not 0 <= i < self.publics:
            raise IndexError(f"public host {i} is not in this lab of {self.publics}")
        return self.internet.address(i)

    def public_command(self, i: int, argv: Sequence[str]) -> list[str]:
        self.public_address(i)
        return self.internet.command(i, argv)

    def router_address(self, k: int) -> str:
        """Router ``k``'s public (WAN) address: where volunteer ``k``'s traffic comes from."""
        self._check(k)
        return self.internet.address(self.publics + k)

    def router_namespace(self, k: int) -> str:
        self._check(k)
        return self.internet.namespace(self.publics + k)

    def router_command(self, k: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.router_namespace(k), *argv]

    def volunteer_address(self, k: int) -> str:
        """Volunteer ``k``'s private address (reachable only from its own router)."""
        self._check(k)
        return f"192.168.{k + 1}.2"

    def volunteer_namespace(self, k: int) -> str:
        self._check(k)
        return f"{self._tag}-v{k}"

    def volunteer_command(self, k: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.volunteer_namespace(k), *argv]

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> NatLab:
        reason = unavailable(self.kinds)
        if reason is not None:
            raise NetLabError(reason)
        sweep()
        try:
            self.internet.__enter__()
            self._scratch = tempfile.TemporaryDirectory(prefix=f"{self._tag}-")
            for k in range(len(self.kinds)):
                self._build_home(k)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build_home(self, k: int) -> None:
        router, home = self.router_namespace(k), self.volunteer_namespace(k)
        gateway, volunteer = f"192.168.{k + 1}.1", self.volunteer_address(k)
        _run(["ip", "netns", "add", home])
        self._created.append(home)
        inside, outside = f"{self._tag}v{k}", f"{self._tag}l{k}"
        _run(["ip", "link", "add", inside, "type", "veth", "peer", "name", outside])
        _run(["ip", "link", "set", inside, "netns", home])
        _run(["ip", "link", "set", outside, "netns", router])
        _run(["ip", "-n", home, "link", "set", inside, "name", "eth0"])
        _run(["ip", "-n", router, "link", "set", outside, "name", LAN])
        _run(["ip", "-n", home, "addr", "add", f"{volunteer}/24", "dev", "eth0"])
        _run(["ip", "-n", router, "addr", "add", f"{gateway}/24", "dev", LAN])
        for ns, dev in ((home, "eth0"), (home, "lo"), (router, LAN)):
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        _run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        _run(
            ["ip", "netns", "exec", router, "nft", "-f", "-"],
            stdin=ruleset(self.kinds[k], volunteer),
        )
        link = self.links[k]
        shape_device(home, "eth0", link.rate_mbit)
        shape_device(router, LAN, link.rate_mbit)
        if link.rtt_ms > 0:
            self._delays.append(
                start_delay_line(home, volunteer, "default", gateway, link.rtt_ms / 2)
            )
            # multicast stays on the LAN, as on a home network (the delay line forwards
            # unicast only): a router's UPnP service is found by SSDP multicast
            _run(["ip", "-n", home, "route", "add", "224.0.0.0/4", "dev", "eth0"])
        else:
            _run(["ip", "-n", home, "route", "add", "default", "via", gateway])
        if self.kinds[k] is RouterKind.PORT_MAPPING:
            self._start_miniupnpd(k)

    def _start_miniupnpd(self, k: int) -> None:
        assert self._scratch is not None
        config = Path(self._scratch.name) / f"miniupnpd-{k}.conf"
        config.write_text(
            f"ext_ifname={WAN}\n"
            f"ext_ip={self.router_address(k)}\n"
            f"listening_ip={LAN}\n"
            "http_port=0\n"
            "enable_upnp=yes\n"
            "enable_natpmp=yes\n"
            "secure_mode=yes\n"
            "system_uptime=yes\n"
            f"uuid=73776172-6d67-7261-646c-6162{k:08x}\n"
            "upnp_table_name=filter\n"
            "upnp_nat_table_name=filter\n"
            "upnp_forward_chain=miniupnpd\n"
            "upnp_nat_chain=prerouting_miniupnpd\n"
            "upnp_nat_postrouting_chain=postrouting_miniupnpd\n"
            f"allow 1024-65535 {self.volunteer_address(k)}/32 1024-65535\n"
            "deny 0-65535 0.0.0.0/0 0-65535\n"
        )
        pidfile = Path(self._scratch.name) / f"miniupnpd-{k}.pid"
        process = subprocess.Popen(
            self.router_command(k, ["miniupnpd", "-d", "-f", str(config), "-P", str(pidfile)]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._processes.append(process)
        # ready once it listens for NAT-PMP on the LAN (port 5351)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if process.poll() is not None:
                _, err = process.communicate()
                raise NetLabError(f"miniupnpd of router {k} stopped: {err.strip()[-500:]}")
            listening = subprocess.run(
                self.router_command(k, ["ss", "-Hlun", "sport", "= :5351"]),
                capture_output=True,
                text=True,
            ).stdout
            if listening.strip():
                return
            time.sleep(0.05)
        raise NetLabError(f"miniupnpd of router {k} did not listen within 10 s")

    def close(self) -> None:
        """Stop the lab's processes and remove its namespaces. Idempotent."""
        while self._processes:
            process = self._processes.pop()
            process.terminate()
            try:
                process.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
        while self._delays:
            stop_delay_line(self._delays.pop())
        while self._created:
            name = self._created.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self.internet.close()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None
