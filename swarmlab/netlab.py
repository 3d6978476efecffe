"""Emulated networks for benchmarks and tests: a slow link or a partition, on one machine.

Each peer gets its own Linux network namespace and address; :class:`NetLab` shapes, cuts
and partitions their links (its docstring has the details), and each peer may have a home
:class:`Link` of its own (:func:`home_links` draws a mix). Nothing outside the lab's
namespaces is touched: no address, route or qdisc of the machine itself.

Needs root, ``ip`` and ``tc`` (iproute2), and a kernel with network namespaces, veth,
bridges and the ``tbf`` qdisc (and TUN devices for delays); :func:`unavailable` says what is
missing. ::

    with NetLab(2, rate_mbit=50, rtt_ms=50) as lab:
        server = subprocess.Popen(lab.command(0, [sys.executable, "serve.py", lab.address(0)]))
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Link",
    "NetLab",
    "NetLabError",
    "home_links",
    "shape_device",
    "start_delay_line",
    "stop_delay_line",
    "unavailable",
]

SUBNET = "10.77.0"
DELAY_SCRIPT = Path(__file__).with_name("netlab_delay.py")
_FORWARD_TABLE = "100"  # where packets leaving the delay line are routed: straight to eth0


@dataclass(frozen=True)
class Link:
    """One peer's connection: ``rate_mbit`` each way (None: line rate) and the round trip
    ``rtt_ms`` it adds (half of it on each packet the peer sends)."""

    rate_mbit: float | None = None
    rtt_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not (
            math.isfinite(self.rate_mbit) and self.rate_mbit > 0
        ):
            raise ValueError(f"a link's rate_mbit must be positive, not {self.rate_mbit}")
        if not (math.isfinite(self.rtt_ms) and 0 <= self.rtt_ms <= 10_000):
            raise ValueError(f"a link's rtt_ms is 0 to 10000, not {self.rtt_ms}")


def home_links(
    peers: int,
    *,
    seed: int = 0,
    rate_mbit: tuple[float, float] = (20.0, 200.0),
    rtt_ms: tuple[float, float] = (10.0, 150.0),
) -> list[Link]:
    """A reproducible mix of ``peers`` home connections: rates and round trips drawn
    log-uniformly from the given ranges (home links cluster at the slow end)."""
    for name, (low, high) in (("rate_mbit", rate_mbit), ("rtt_ms", rtt_ms)):
        if not 0 < low <= high:
            raise ValueError(f"{name} is a range (low, high) with 0 < low <= high")
    draw = random.Random(seed)

    def log_uniform(low: float, high: float) -> float:
        return math.exp(draw.uniform(math.log(low), math.log(high)))

    return [
        Link(round(log_uniform(*rate_mbit), 1), round(log_uniform(*rtt_ms), 1))
        for _ in range(peers)
    ]


class NetLabError(RuntimeError):
    """A command that sets up or changes the lab failed (its stderr is in the message)."""


def unavailable() -> str | None:
    """Why a lab cannot be made here, in one line; None if it can."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2"
    return None


def _delays_unavailable() -> str | None:
    if not os.path.exists("/dev/net/tun"):
        return "link delays need TUN devices (/dev/net/tun is missing)"
    return None


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        raise NetLabError(f"{' '.join(argv)}: {detail or f'exit {done.returncode}'}")


def shape_device(namespace: str, device: str, rate_mbit: float | None) -> None:
    """Give what ``device`` in ``namespace`` sends a token-bucket rate of ``rate_mbit``
    (None: line rate again)."""
    subprocess.run(
        ["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"],
        capture_output=True,
        check=False,
    )
    if rate_mbit is None:
        return
    # a burst of a few milliseconds at the rate (at least 64 KiB); a queue of up to 100 ms
    # before tbf drops
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
    _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf])


def start_delay_line(
    namespace: str, source: str, destination: str, gateway: str | None, one_way_ms: float
) -> subprocess.Popen[str]:
    """Route what ``namespace`` (address ``source`` on ``eth0``) sends to ``destination``
    (a prefix, or ``default``) through a TUN device whose packets a process of ours holds
    for ``one_way_ms`` before they go out on ``eth0`` (through ``gateway`` if given). The
    caller stops the process by closing its standard input (:func:`stop_delay_line`)."""
    ns, via = namespace, ["via", gateway] if gateway else []
    _run(["ip", "-n", ns, "tuntap", "add", "dev", "tun0", "mode", "tun"])
    _run(["ip", "-n", ns, "link", "set", "tun0", "up"])
    # packets come back out of tun0 with this namespace's own source address: forward them
    # (ip_forward), and accept a local source on tun0 (accept_local, no reverse-path
    # filter); all of it inside the namespace
    _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1",
          "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.tun0.rp_filter=0",
          "net.ipv4.conf.tun0.accept_local=1"])  # fmt: skip
    _run(["ip", "-n", ns, "route", "add", destination, "dev", "tun0", "src", source])
    _run(["ip", "-n", ns, "route", "add", destination, *via, "dev", "eth0",
          "table", _FORWARD_TABLE])  # fmt: skip
    _run(["ip", "-n", ns, "rule", "add", "iif", "tun0", "lookup", _FORWARD_TABLE])
    process = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-I", str(DELAY_SCRIPT), "tun0",
         str(one_way_ms)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        _, err = process.communicate()
        raise NetLabError(f"the delay line of {ns} did not start: {err.strip()}")
    return process


def stop_delay_line(process: subprocess.Popen[str]) -> None:
    """Stop a process of :func:`start_delay_line` (closing its standard input)."""
    try:
        process.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()


class NetLab:
    """``peers`` network namespaces on one bridge; a context manager that removes them.

    Each peer gets its own Linux network namespace with one interface, ``eth0``, at
    ``10.77.0.<i+1>``; the other end of its veth pair sits on a bridge in a switch namespace
    of the lab's own. :meth:`NetLab.shape` gives every link a token-bucket rate (tc's ``tbf``,
    applied both ways, so a peer uploads and downloads at that rate), :meth:`NetLab.cut`
    takes a peer off the bridge, and :meth:`NetLab.partition` splits the lab into sides that
    cannot reach each other until :meth:`NetLab.heal` (each side on a bridge of its own).
    Processes run inside a peer's namespace through :meth:`NetLab.command` (``ip netns exec``).
    Nothing outside the lab's namespaces is touched: no address, route or qdisc of the machine
    itself.

    Home links: ``rtt_ms`` gives every link a propagation delay, and ``links`` gives each peer a
    :class:`Link` of its own (:func:`home_links` draws a mix of home connections). A peer whose
    link has a round trip of R holds every packet it sends for R/2 (:mod:`swarmlab.netlab_delay`:
    netem is missing from these kernels, so the packets go through a TUN device and a small
    process that keeps them), so two peers with links of R1 and R2 see a round trip of
    (R1 + R2) / 2 between them, and peers with equal links exactly their link's.
    """

    def __init__(
        self,
        peers: int,
        *,
        rate_mbit: float | None = None,
        rtt_ms: float | None = None,
        links: Sequence[Link] | None = None,
        tag: str | None = None,
        subnet: str = SUBNET,
    ) -> None:
        """``tag`` names the lab's namespaces and interfaces (at most 9 characters; a
        fresh random one by default); peers are numbered in the /24 ``subnet`` (its first
        three octets)."""
        if not 1 <= peers <= 250:
            raise ValueError("a lab has 1 to 250 peers")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError("rate_mbit must be positive")
        if links is not None:
            if rate_mbit is not None or rtt_ms is not None:
                raise ValueError("give either links (one per peer) or rate_mbit and rtt_ms")
            if len(links) != peers or not all(isinstance(link, Link) for link in links):
                raise ValueError(f"links needs one Link per peer ({peers}), got {len(links)}")
        self.peers = peers
        self.rate_mbit = rate_mbit
        # each peer's link; Link() validates rtt_ms
        self.links = list(links) if links is not None else [Link(rate_mbit, rtt_ms or 0.0)] * peers
        self._delays: list[subprocess.Popen[str]] = []
        # short and unique: interface names have at most 15 characters
        self.subnet = subnet
        self._tag = tag or f"sg{uuid.uuid4().hex[:6]}"
        if len(self._tag) > 9:
            raise ValueError("a lab's tag has at most 9 characters (interface names: 15)")
        self._switch = f"{self._tag}-sw"
        self._created: list[str] = []
        self._bridges = 1  # br0, br1, ...: one per side of a partition

    # ----------------------------------------------------------------- names and commands

    def namespace(self, i: int) -> str:
        self._check(i)
        return f"{self._tag}-{i}"

    def address(self, i: int) -> str:
        """Peer ``i``'s IPv4 address (reachable from every other peer of the lab)."""
        self._check(i)
        return f"{self.subnet}.{i + 1}"

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` to run inside peer ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def _check(self, i: int) -> None:
        if not 0 <= i < self.peers:
            raise IndexError(f"peer {i} is not in this lab of {self.peers}")

    def _port(self, i: int) -> str:
        return f"{self._tag}s{i}"  # peer i's veth end on the bridge

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> NetLab:
        reason = unavailable()
        if reason is not None:
            raise NetLabError(reason)
        delayed = any(link.rtt_ms > 0 for link in self.links)
        reason = _delays_unavailable() if delayed else None
        if reason is not None:
            raise NetLabError(reason)
        try:
            self._build()
            for i, link in enumerate(self.links):
                self._shape_peer(i, link.rate_mbit)
            if delayed:
                for i in range(self.peers):
                    self._delay(i, self.links[i].rtt_ms / 2)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build(self) -> None:
        self._add_namespace(self._switch)
        _run(["ip", "-n", self._switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self._switch, "link", "set", "br0", "up"])
        for i in range(self.peers):
            ns, inside, port = self.namespace(i), f"{self._tag}p{i}", self._port(i)
            self._add_namespace(ns)
            _run(["ip", "link", "add", inside, "type", "veth", "peer", "name", port])
            _run(["ip", "link", "set", inside, "netns", ns])
            _run(["ip", "link", "set", port, "netns", self._switch])
            _run(["ip", "-n", ns, "link", "set", inside, "name", "eth0"])
            # no prefix route: with delays the lab's subnet is routed through the delay line
            address = f"{self.address(i)}/24"
            _run(["ip", "-n", ns, "addr", "add", address, "dev", "eth0", "noprefixroute"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", self._switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", self._switch, "link", "set", port, "up"])
            if not any(link.rtt_ms > 0 for link in self.links):
                _run(["ip", "-n", ns, "route", "add", f"{self.subnet}.0/24", "dev", "eth0"])

    def _delay(self, i: int, one_way_ms: float) -> None:
        """Route what peer ``i`` sends to the lab through a delay line of ``one_way_ms``."""
        line = start_delay_line(
            self.namespace(i), self.address(i), f"{self.subnet}.0/24", None, one_way_ms
        )
        self._delays.append(line)

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    def close(self) -> None:
        """Stop the delay lines, remove the lab's namespaces (their interfaces go with them).
        Idempotent."""
        while self._delays:
            stop_delay_line(self._delays.pop())
        while self._created:
            name = self._created.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)

    # ----------------------------------------------------------------- conditions

    def shape(self, rate_mbit: float | None) -> None:
        """Limit every link to ``rate_mbit`` in each direction (None: line rate again); the
        links keep their delays."""
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError("rate_mbit must be positive")
        for i in range(self.peers):
            self._shape_peer(i, rate_mbit)
            self.links[i] = Link(rate_mbit, self.links[i].rtt_ms)
        self.rate_mbit = rate_mbit

    def _shape_peer(self, i: int, rate_mbit: float | None) -> None:
        shape_device(self.namespace(i), "eth0", rate_mbit)
        shape_device(self._switch, self._port(i), rate_mbit)

    def cut(self, i: int) -> None:
        """Take peer ``i`` off the network (its link goes down; it keeps its loopback)."""
        _run(["ip", "-n", self._switch, "link", "set", self._port(i), "down"])

    def restore(self, i: int) -> None:
        """Undo :meth:`cut`."""
        _run(["ip", "-n", self._switch, "link", "set", self._port(i), "up"])

    def partition(self, *sides: Sequence[int]) -> None:
        """Split the lab: peers on the same side reach each other, peers on different sides
        do not (their packets are lost, as across a broken route: no reset, no error). Every
        peer must be on exactly one side. :meth:`heal` joins the sides again."""
        placed = sorted(i for side in sides for i in side)
        if len(sides) < 2 or any(not side for side in sides) or placed != list(range(self.peers)):
            raise ValueError(
                f"a partition puts each of the lab's {self.peers} peers on exactly one of two "
                f"or more non-empty sides; got {[list(side) for side in sides]}"
            )
        self.heal()
        for b in range(1, len(sides)):
            _run(["ip", "-n", self._switch, "link", "add", f"br{b}", "type", "bridge"])
            _run(["ip", "-n", self._switch, "link", "set", f"br{b}", "up"])
            self._bridges += 1
        for b, side in enumerate(sides):
            for i in side:
                _run(["ip", "-n", self._switch, "link", "set", self._port(i), "master", f"br{b}"])

    def heal(self) -> None:
        """Undo :meth:`partition`: every peer on one bridge again (a no-op if whole)."""
        for i in range(self.peers):
            if self._bridges > 1:
                _run(["ip", "-n", self._switch, "link", "set", self._port(i), "master", "br0"])
        while self._bridges > 1:
            self._bridges -= 1
            _run(["ip", "-n", self._switch, "link", "del", f"br{self._bridges}"])


def run_workers(
    lab: NetLab, script: str, configs: Sequence[dict[str, object]], timeout: float
) -> list[list[dict[str, object]]]:
    """Run ``python script --worker CONFIG`` once per config, the i-th in peer i's namespace,
    and return each worker's JSON lines on stdout (in rank order). A worker that fails or
    outlives ``timeout`` ends the benchmark with the tail of its stderr; the others are
    killed, never left behind."""
    processes = [
        subprocess.Popen(
            lab.command(rank, [sys.executable, script, "--worker", json.dumps(cfg)]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for rank, cfg in enumerate(configs)
    ]
    outputs = []
    try:
        for rank, process in enumerate(processes):
            try:
                out, err = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"peer {rank} did not finish within {timeout:.0f} s") from None
            if process.returncode != 0:
                tail = "\n".join(err.strip().splitlines()[-15:])
                raise SystemExit(f"peer {rank} failed (exit {process.returncode}):\n{tail}")
            outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return outputs
