"""``swarmgrad relay``: a relay for the volunteers of a public run who cannot dial each other
(:mod:`peer.transport.relay_server`).

The relay checks each peer's run certificate with the run's public key. It learns the keys
from the coordinator (``--coordinator URL``: each run's public page, fetched the first time
a peer of that run shows up) or from its own configuration (``--run RUN_ID=PUBLIC_KEY``).
It needs nothing of the coordinator's stack; one process serves every run it knows.

What it carries is printed every ``--stats-every`` seconds (and written, as JSON, to
``--stats-file`` when given): peers registered, circuits, bytes carried.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Annotated

import typer

from peer.coordinator import CoordinatorClient
from peer.coordinator.exceptions import CoordinatorError, NotFound
from peer.exceptions import RelayRefused, TransportError
from peer.formats.identity import PUBLIC_KEY_SIZE
from peer.transport.relay import parse_relay_address
from peer.transport.relay_protocol import RelayLimits
from peer.transport.relay_server import RelayServer, RunKeys, StaticRunKeys
from swarmgrad.errors import UsageError

logger = logging.getLogger("swarmgrad.relay")

_MIB = 2**20
_GIB = 2**30
_DEFAULTS = RelayLimits()


class CoordinatorRunKeys:
    """Run keys from a coordinator's public run pages, fetched once per run (a run's key
    never changes). A run the coordinator does not know is remembered as such for
    ``miss_ttl`` seconds, and lookups go one at a time: strangers naming made-up runs in
    their hellos cost the coordinator one request a run a minute, at most."""

    def __init__(self, url: str, *, miss_ttl: float = 60.0, max_misses: int = 4096) -> None:
        self.client = CoordinatorClient(url)
        self.miss_ttl = miss_ttl
        self.max_misses = max_misses
        self._keys: dict[str, bytes] = {}
        self._misses: dict[str, float] = {}
        self._lock = asyncio.Lock()

    async def __call__(self, run_id: str) -> bytes | None:
        key = self._keys.get(run_id)
        if key is not None:
            return key
        async with self._lock:
            now = time.monotonic()
            if now - self._misses.get(run_id, -self.miss_ttl) < self.miss_ttl:
                return None
            try:
                run = await asyncio.to_thread(self.client.run, run_id)
            except NotFound:
                if len(self._misses) >= self.max_misses:
                    self._misses.clear()
                self._misses[run_id] = now
                return None
            except CoordinatorError as exc:
                raise RelayRefused(
                    f"cannot check run {run_id!r} with the coordinator now ({exc}): try later"
                ) from None
            key = base64.urlsafe_b64decode(run.public_key)
            self._keys[run_id] = key
            return key

    def close(self) -> None:
        self.client.close()


def _static_keys(runs: list[str]) -> StaticRunKeys:
    keys: dict[str, bytes] = {}
    for item in runs:
        run_id, sep, text = item.partition("=")
        try:
            key = base64.urlsafe_b64decode(text.strip().encode("ascii"))
        except (binascii.Error, ValueError):
            key = b""
        if not sep or not run_id.strip() or len(key) != PUBLIC_KEY_SIZE:
            raise UsageError(
                f"--run takes RUN_ID=PUBLIC_KEY (the run's public key in base64, as "
                f"`swarmgrad runs show` prints it), not {item!r}"
            )
        keys[run_id.strip()] = key
    return StaticRunKeys(keys)


def relay(
    coordinator: Annotated[
        str | None,
        typer.Option(
            "--coordinator",
            envvar="SWARMGRAD_RELAY_COORDINATOR",
            show_envvar=True,
            help="Serve every run of this coordinator (its URL): run keys are fetched from it.",
        ),
    ] = None,
    run: Annotated[
        list[str] | None,
        typer.Option(
            "--run",
            help="Serve this run: RUN_ID=PUBLIC_KEY (base64). Repeat for several.",
            show_default=False,
        ),
    ] = None,
    host: Annotated[
        str, typer.Option(envvar="SWARMGRAD_RELAY_HOST", help="Address to listen on.")
    ] = "0.0.0.0",
    port: Annotated[
        int, typer.Option(envvar="SWARMGRAD_RELAY_PORT", help="TCP port to listen on.")
    ] = 4100,
    public_address: Annotated[
        str | None,
        typer.Option(
            envvar="SWARMGRAD_RELAY_PUBLIC_ADDRESS",
            help="The address volunteers dial, relay://host:port (default: the listening one).",
        ),
    ] = None,
    rate_mib: Annotated[
        float,
        typer.Option(
            envvar="SWARMGRAD_RELAY_RATE_MIB",
            help="MiB/s one volunteer may send through the relay.",
        ),
    ] = _DEFAULTS.rate / _MIB,
    cap_gib: Annotated[
        float,
        typer.Option(
            envvar="SWARMGRAD_RELAY_CAP_GIB",
            help="GiB one volunteer may send through the relay per hour.",
        ),
    ] = _DEFAULTS.byte_cap / _GIB,
    max_peers: Annotated[
        int, typer.Option(envvar="SWARMGRAD_RELAY_MAX_PEERS", help="Peers registered at once.")
    ] = _DEFAULTS.max_peers,
    max_circuits: Annotated[
        int, typer.Option(envvar="SWARMGRAD_RELAY_MAX_CIRCUITS", help="Circuits at once.")
    ] = _DEFAULTS.max_circuits,
    max_circuits_per_peer: Annotated[
        int,
        typer.Option(
            envvar="SWARMGRAD_RELAY_MAX_CIRCUITS_PER_PEER", help="Circuits of one volunteer."
        ),
    ] = _DEFAULTS.max_circuits_per_peer,
    stats_file: Annotated[
        Path | None,
        typer.Option(help="Write what the relay carried here (JSON), rewritten as it goes."),
    ] = None,
    stats_every: Annotated[
        float, typer.Option(help="Seconds between two stats lines (and stats file updates).")
    ] = 60.0,
) -> None:
    """Run a relay for volunteers who cannot reach each other directly (NAT, firewalls)."""
    if not coordinator and not run:
        raise UsageError("say which runs to serve: --coordinator URL, or --run RUN_ID=KEY")
    if public_address is not None:
        try:
            if parse_relay_address(public_address).peer_id is not None:
                raise ValueError
        except ValueError:
            raise UsageError(
                f"--public-address is relay://host:port, not {public_address!r}"
            ) from None
    try:
        limits = RelayLimits(
            max_peers=max_peers,
            max_circuits=max_circuits,
            max_circuits_per_peer=max_circuits_per_peer,
            rate=rate_mib * _MIB,
            burst=max(rate_mib * _MIB, 1.0),
            byte_cap=int(cap_gib * _GIB),
        )
    except ValueError as exc:
        raise UsageError(f"relay limits: {exc}") from None
    if stats_every <= 0:
        raise UsageError("--stats-every must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    static = _static_keys(run or [])
    keys = CoordinatorRunKeys(coordinator) if coordinator else None

    async def lookup(run_id: str) -> bytes | None:
        found = await static(run_id)
        if found is None and keys is not None:
            found = await keys(run_id)
        return found

    try:
        asyncio.run(_serve(lookup, host, port, limits, public_address, stats_file, stats_every))
    finally:
        if keys is not None:
            keys.close()


async def _serve(
    keys: RunKeys,
    host: str,
    port: int,
    limits: RelayLimits,
    public_address: str | None,
    stats_file: Path | None,
    stats_every: float,
) -> None:
    server = RelayServer(keys, host=host, port=port, limits=limits, public_address=public_address)
    try:
        await server.start()
    except OSError as exc:
        raise TransportError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    print(
        f"relay listening at {server.address}: per volunteer {limits.rate / _MIB:g} MiB/s, "
        f"{limits.byte_cap / _GIB:g} GiB per hour, {limits.max_circuits_per_peer} circuits",
        flush=True,
    )
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), stats_every)
            _report(server, stats_file)
    finally:
        await server.close()
        _report(server, stats_file)


def _report(server: RelayServer, stats_file: Path | None) -> None:
    stats = server.stats()
    logger.info(
        "%d peers, %d circuits, %d bytes carried, %d refusals",
        stats["peers"],
        stats["circuits"],
        stats["bytes_carried"],
        stats["refusals"],
    )
    if stats_file is not None:
        temporary = stats_file.with_name(stats_file.name + ".tmp")
        temporary.write_text(json.dumps({**stats, "time": time.time()}) + "\n")
        os.replace(temporary, stats_file)
