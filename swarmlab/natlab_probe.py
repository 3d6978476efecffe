"""Small network probes for :mod:`swarmlab.natlab`, run as a script inside a lab namespace.

Each prints one line of JSON and exits (no ``peer`` import, so it starts quickly)::

    natlab_probe.py observe PORT           # TCP and UDP on PORT: answer each client with
                                           # the address it came from, until killed;
                                           # prints {"ready": true} once listening
    natlab_probe.py tcp HOST PORT [--from LOCAL] [--timeout S]
        # connect (from local port LOCAL), print {"seen": "ip:port"} -- what an observer
        # answered -- or {"connected": true} for another listener, or {"error": "timeout"
        # | "refused" | ...}
    natlab_probe.py udp HOST PORT [--from LOCAL] [--timeout S]
        # one datagram to an observer; {"seen": "ip:port"} or {"error": "timeout"}
    natlab_probe.py listen PORT [--udp] [--timeout S]
        # wait for one TCP connection (or one datagram); {"from": "ip:port"} or
        # {"error": "timeout"}; prints {"ready": true} first
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys


def _print(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _bound(kind: int, local: int | None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if local:
        sock.bind(("0.0.0.0", local))
    return sock


def observe(port: int) -> None:
    tcp = _bound(socket.SOCK_STREAM, port)
    tcp.listen(16)
    udp = _bound(socket.SOCK_DGRAM, port)
    _print(ready=True)
    while True:
        readable, _, _ = select.select([tcp, udp], [], [])
        if tcp in readable:
            client, (host, peer_port) = tcp.accept()
            client.sendall(f"{host}:{peer_port}\n".encode())
            client.close()
        if udp in readable:
            _, (host, peer_port) = udp.recvfrom(2048)
            udp.sendto(f"{host}:{peer_port}".encode(), (host, peer_port))


def tcp(host: str, port: int, local: int | None, timeout: float) -> None:
    sock = _bound(socket.SOCK_STREAM, local)
    sock.settimeout(timeout)
    try:
        sock.connect((host, port))
        answer = sock.recv(64).decode().strip()
    except TimeoutError:
        _print(error="timeout")
        return
    except ConnectionRefusedError:
        _print(error="refused")
        return
    except OSError as exc:
        _print(error=str(exc))
        return
    _print(seen=answer) if answer else _print(connected=True)


def udp(host: str, port: int, local: int | None, timeout: float) -> None:
    sock = _bound(socket.SOCK_DGRAM, local)
    sock.settimeout(timeout)
    sock.sendto(b"?", (host, port))
    try:
        answer, _ = sock.recvfrom(2048)
    except TimeoutError:
        _print(error="timeout")
        return
    _print(seen=answer.decode())


def listen(port: int, datagram: bool, timeout: float) -> None:
    sock = _bound(socket.SOCK_DGRAM if datagram else socket.SOCK_STREAM, port)
    if not datagram:
        sock.listen(1)
    sock.settimeout(timeout)
    _print(ready=True)
    try:
        if datagram:
            _, (host, peer_port) = sock.recvfrom(2048)
        else:
            _, (host, peer_port) = sock.accept()
    except TimeoutError:
        _print(error="timeout")
        return
    _print(**{"from": f"{host}:{peer_port}"})


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="natlab_probe")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("observe").add_argument("port", type=int)
    for name in ("tcp", "udp"):
        sub = commands.add_parser(name)
        sub.add_argument("host")
        sub.add_argument("port", type=int)
        sub.add_argument("--from", dest="local", type=int)
        sub.add_argument("--timeout", type=float, default=5.0)
    sub = commands.add_parser("listen")
    sub.add_argument("port", type=int)
    sub.add_argument("--udp", action="store_true")
    sub.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.command == "observe":
        observe(args.port)
    elif args.command == "tcp":
        tcp(args.host, args.port, args.local, args.timeout)
    elif args.command == "udp":
        udp(args.host, args.port, args.local, args.timeout)
    else:
        listen(args.port, args.udp, args.timeout)


if __name__ == "__main__":
    main(sys.argv[1:])
