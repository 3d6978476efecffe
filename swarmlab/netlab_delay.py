"""Propagation delay for :mod:`swarmlab.netlab`, in user space: a TUN device that holds packets.

Netem is missing from the kernels this project runs on, so every packet a peer sends to the
lab's subnet goes through a TUN device and this process, which keeps it for the link's
one-way delay (:class:`DelayLine` has the rules). Run by :class:`swarmlab.netlab.NetLab` as
a plain script (no ``peer`` import, so it starts in a fraction of a second)::

    ip netns exec NS python swarmlab/netlab_delay.py tun0 25.0

It attaches to the (persistent) TUN device, prints ``ready`` and runs until killed or until
its standard input closes (its parent gone).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET = 65536


class DelayLine:
    """Packets in, the same packets out ``delay`` seconds later, in order; no I/O.

    ``limit`` bounds the bytes held: a packet arriving at a full line is dropped (counted
    in :attr:`dropped`).

    The kernels this project runs on have tc's token bucket but not ``netem``, so a lab link
    cannot be given a delay by a qdisc. Instead every packet a peer sends to the lab's subnet
    is routed into a TUN device; this process, running in the peer's namespace, reads each
    packet, keeps it for the link's one-way delay and writes it back, and policy routing then
    sends what comes out of the TUN device on to ``eth0`` (where the token bucket shapes it).
    Packets are released in arrival order (one constant delay per link keeps them in order);
    a queue holding more than ``--limit`` bytes drops what arrives, as a router's buffer would.
    Inbound packets are delivered directly, so a path's one-way delay is the sender's. The
    process raises its own priority: on a machine loaded past its cores, a starved delay line
    would pass fewer Mbit/s than the link's rate (tests/peer/test_netlab.py bounds it).
    """

    def __init__(self, delay: float, limit: int) -> None:
        if delay < 0:
            raise ValueError("a delay is not negative")
        if limit <= 0:
            raise ValueError("the queue limit must be positive")
        self.delay = delay
        self.limit = limit
        self.held = 0
        self.dropped = 0
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()

    def push(self, packet: bytes, now: float) -> bool:
        """Hold ``packet`` from ``now``; False (and dropped) when the line is full."""
        if self.held + len(packet) > self.limit:
            self.dropped += 1
            return False
        self._queue.append((now + self.delay, packet))
        self.held += len(packet)
        return True

    def due(self, now: float) -> list[bytes]:
        """The packets whose delay has passed by ``now``, oldest first."""
        out = []
        while self._queue and self._queue[0][0] <= now:
            packet = self._queue.popleft()[1]
            self.held -= len(packet)
            out.append(packet)
        return out

    def next_due(self) -> float | None:
        """When the oldest held packet is due; None when nothing is held."""
        return self._queue[0][0] if self._queue else None


def attach(name: str) -> int:
    """Open the TUN device ``name`` (already created and up); its file descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        os.set_blocking(fd, False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def serve(fd: int, line: DelayLine, stop: int) -> None:
    """Move packets from ``fd`` through ``line`` back into ``fd`` until ``stop`` (a file
    descriptor) becomes readable: closed, or written to."""
    while True:
        due = line.next_due()
        timeout = None if due is None else max(0.0, due - time.monotonic())
        readable, _, _ = select.select([fd, stop], [], [], timeout)
        if stop in readable:
            return
        if fd in readable:
            now = time.monotonic()
            while True:
                try:
                    packet = os.read(fd, MAX_PACKET)
                except BlockingIOError:
                    break
                line.push(packet, now)
        for packet in line.due(time.monotonic()):
            try:
                os.write(fd, packet)
            except OSError:
                line.dropped += 1  # the device refused it (full): lost, as on a wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("device", help="name of the TUN device in this namespace")
    parser.add_argument("delay_ms", type=float, help="one-way delay of every packet")
    parser.add_argument("--limit", type=int, default=16 << 20, help="bytes held at most")
    args = parser.parse_args()
    try:
        line = DelayLine(args.delay_ms / 1000.0, args.limit)
        fd = attach(args.device)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"netlab_delay: {exc}") from None
    with contextlib.suppress(OSError):
        # a link, not a workload: ahead of the peers' compute on a loaded machine (root may)
        os.nice(-10)
    print("ready", flush=True)
    serve(fd, line, sys.stdin.fileno())


if __name__ == "__main__":
    main()
