"""Run a node in its own OS process and drive it over a line protocol.

Used by the multi-process tests and benchmarks, and handy for testing a swarm from a
checkout (it is not in the wheel). ``python -m swarmlab.node_process [--initial-peer ADDR ...]
[--gossip-period S] ...`` starts a node, prints one JSON line ``{"peer_id": ..., "addresses": [...]}``, then answers JSON
commands on standard input, one per line, with one JSON line each::

    {"cmd": "store", "key": "k", "value": 1, "ttl": 30, "subkey": null}  -> {"ok": true}
    {"cmd": "get", "key": "k"}                                           -> {"value": ..., "expiration": ...}
    {"cmd": "members"}                                                   -> {"members": [...]}
    {"cmd": "stats"}                                                     -> {"rounds": ..., "exchanges": ...}
    {"cmd": "quit"}                                                      -> {"ok": true}, then exits

Logs (WARNING and above by default) go to standard error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from peer.node.gossip import ValueWithExpiration

if TYPE_CHECKING:
    from peer.node import Node

T = TypeVar("T")


def _jsonable(value: Any) -> Any:
    if isinstance(value, ValueWithExpiration):
        return {"value": _jsonable(value.value), "expiration": value.expiration_time}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--gossip-period", type=float, default=1.0)
    parser.add_argument("--member-ttl", type=float, default=30.0)
    parser.add_argument("--fanout", type=int, default=3)
    parser.add_argument("--request-timeout", type=float, default=5.0)
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--swarm-key-hex", default=None)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s"
    )
    from peer.formats.identity import SwarmKeyAuth
    from peer.node import Node

    auth = SwarmKeyAuth(bytes.fromhex(args.swarm_key_hex)) if args.swarm_key_hex else None
    node = Node(
        args.initial_peer,
        gossip_period=args.gossip_period,
        member_ttl=args.member_ttl,
        fanout=args.fanout,
        request_timeout=args.request_timeout,
        client_mode=args.client_mode,
        auth=auth,
    )

    def store(command: dict[str, Any]) -> Any:
        ttl = node.get_time() + float(command["ttl"])
        return {"ok": node.store(command["key"], command["value"], ttl, command.get("subkey"))}

    try:
        serve_json_lines(
            node,
            {
                "store": store,
                "get": lambda c: _jsonable(node.get(c["key"], latest=bool(c.get("latest", False)))),
                "members": lambda c: {"members": sorted(node.members())},
                "stats": lambda c: {
                    "rounds": node.core.gossip.rounds,
                    "exchanges": node.core.gossip.exchanges,
                },
            },
        )
    finally:
        node.shutdown()


def serve_json_lines(node: Node, handlers: dict[str, Callable[[dict[str, Any]], Any]]) -> None:
    """The child side of the JSON-line protocol: announce ``node``'s peer id and addresses,
    then answer each command on standard input with ``handlers[cmd](command)`` until
    ``{"cmd": "quit"}`` or end of input."""
    out = sys.stdout
    out.write(json.dumps({"peer_id": node.peer_id, "addresses": node.visible_addresses}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        cmd = command.get("cmd")
        if cmd == "quit":
            out.write(json.dumps({"ok": True}) + "\n")
            out.flush()
            return
        handler = handlers.get(cmd)
        reply = handler(command) if handler else {"error": f"unknown command {cmd!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class ChildProcess:
    """A peer in a child process that speaks the JSON-line protocol: it prints one line
    ``{"peer_id": ..., "addresses": [...]}`` when ready, then answers one JSON line per
    command. Subclasses add typed helpers around :meth:`call`."""

    what = "peer"

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        first = self.proc.stdout.readline() if self.proc.stdout else ""
        if not first:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"{self.what} process failed to start:\n{err}")
        info = json.loads(first)
        self.peer_id: str = info["peer_id"]
        self.addresses: list[str] = info["addresses"]

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.what} process {self.peer_id} exited")
        return json.loads(line)

    def call(self, **command: Any) -> Any:
        self.send(**command)
        return self.receive()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> str:
        """SIGKILL (no goodbye, no close handshake) if still running, release the pipes, and
        return what it had logged."""
        if self.alive:
            self.proc.kill()
        _, err = self.proc.communicate()
        return err or ""

    def quit(self, timeout: float = 10.0) -> str:
        """Ask it to shut down cleanly; returns what it logged to standard error."""
        if self.alive:
            try:
                self.call(cmd="quit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err or ""


class NodeProcess(ChildProcess):
    """A node in a child process (``python -m swarmlab.node_process``), driven from the parent."""

    what = "node"

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__([sys.executable, "-m", "swarmlab.node_process", *args], env)

    def store(self, key: str, value: Any, ttl: float, subkey: Any = None) -> bool:
        return bool(self.call(cmd="store", key=key, value=value, ttl=ttl, subkey=subkey)["ok"])

    def get(self, key: str, latest: bool = False) -> Any:
        return self.call(cmd="get", key=key, latest=latest)

    def members(self) -> list[str]:
        return [str(member) for member in self.call(cmd="members")["members"]]


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.1) -> T:
    """Poll ``predicate`` until it returns something true or ``timeout`` seconds pass; returns
    its last value (so ``assert wait_until(...)`` fails on a timeout). The one polling helper of
    the tests and benchmarks; tests pass a timeout scaled by ``tests.conftest.scaled``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], T], timeout: float, interval: float = 0.05) -> T:
    """:func:`wait_until` inside an event loop: polls ``predicate`` while the loop runs,
    measuring ``timeout`` on the loop's own clock (so it costs nothing under a virtual-time
    loop). Returns the predicate's last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if result or loop.time() >= deadline:
            return result
        await asyncio.sleep(interval)


if __name__ == "__main__":
    main()
