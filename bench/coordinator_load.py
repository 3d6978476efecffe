"""Coordinator report ingestion under load, over real HTTP to a real uvicorn.

Starts ``swarmgrad coordinator`` in a subprocess (loopback only) on a fresh SQLite file and/or
a fresh PostgreSQL schema, joins ``--peers`` simulated peers through the API, then has them
post progress reports as fast as ``--concurrency`` requests in flight allow for
``--duration`` seconds, from ``--client-processes`` load-generator processes. Prints
reports/s, p50/p99 latency, and — as the figure that survives a change of machine — the
ratio to ``GET /healthz`` (one trivial query) measured by the same client in the same run.
After a clean shutdown it checks that every acknowledged report was stored.

    python bench/coordinator_load.py                       # both backends, defaults
    python bench/coordinator_load.py --backend sqlite --workers 2 --duration 20

A run of 10,000 volunteers reporting every 5 s is 2,000 reports/s.

With ``--volunteers N`` it asks instead whether the coordinator keeps up with a swarm: N
volunteers join (each with its own key: challenge, proof of possession), then each reports
every ``--interval`` seconds on schedule (open loop), while bootstrap calls, certificate
renewals and the dashboard's data are asked for beside them (``--side-rate`` each per second)
and a WebSocket client of the run's live feed, standing in for a browser, times a report of
one more volunteer until the frame that shows it. It prints reports/s, p50/p99 per endpoint
(the side calls' over the run after its first ``--warmup`` seconds, the cold start's worst
apart), the lag behind the schedule, the coordinator's CPU, the database's growth per hour, and checks
that every acknowledged report was stored (docs/deploy.md has figures):

    python bench/coordinator_load.py --backend postgresql --volunteers 10000 --interval 10 \
        --duration 60 --workers 2 --concurrency 64 --client-processes 2

``--swarm-file swarm.json`` keeps the joined swarm for the next runs (they skip the joins).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from peer.formats.identity import Identity, join_proof_payload  # noqa: E402
from server.models import ProgressReport  # noqa: E402

ADMIN = "bench-admin-" + secrets.token_urlsafe(32)
GOAL_REPORT_P99_MS = 100.0
GOAL_DASHBOARD_P99_MS = 250.0
DEFAULT_POSTGRES = os.environ.get(
    "SWARMGRAD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@dataclass
class Result:
    name: str
    ok: int
    errors: int
    seconds: float
    latencies_ms: list[float]
    sent_at_s: list[float] | None = None  # when each call was sent, from the load's start

    def after(self, warmup_s: float) -> Result:
        """The calls sent after the first ``warmup_s`` seconds (all without send times)."""
        if not self.sent_at_s:
            return self
        pairs = zip(self.latencies_ms, self.sent_at_s, strict=True)
        kept = [(ms, at) for ms, at in pairs if at >= warmup_s]
        return Result(
            self.name,
            self.ok,
            self.errors,
            self.seconds,
            [ms for ms, _ in kept],
            [at for _, at in kept],
        )

    def worst_before(self, warmup_s: float) -> float:
        """The slowest call sent in the first ``warmup_s`` seconds (ms; 0 if none)."""
        sent = self.sent_at_s or []
        early = [ms for ms, at in zip(self.latencies_ms, sent, strict=False) if at < warmup_s]
        return max(early, default=0.0)

    def slowest(self, count: int = 3) -> str:
        """The slowest calls, each with when it was sent: a cold start shows as early ones."""
        if not self.sent_at_s:
            return ""
        worst = sorted(zip(self.latencies_ms, self.sent_at_s, strict=True), reverse=True)
        return ", ".join(f"{ms:.0f} ms at {at:.0f} s" for ms, at in worst[:count])

    @property
    def rate(self) -> float:
        return self.ok / self.seconds

    def quantile(self, q: float) -> float:
        if len(self.latencies_ms) < 2:
            return float("nan")
        return statistics.quantiles(self.latencies_ms, n=100, method="inclusive")[int(q * 100) - 1]


def process_tree_cpu_seconds(root: int) -> float | None:
    """User + system CPU time of ``root`` and its descendants (Linux ``/proc``), or None."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    stats: dict[int, tuple[int, float]] = {}
    try:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    except OSError:
        return None
    if root not in stats:
        return None
    total, frontier = 0.0, [root]
    while frontier:
        pid = frontier.pop()
        total += stats[pid][1]
        frontier.extend(child for child, (ppid, _) in stats.items() if ppid == pid)
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    database_url: str,
    workers: int,
    flush_interval: float,
    auth_cache_ttl: float,
    secret_key: str | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
    env.update(
        SWARMGRAD_ENVIRONMENT="production",
        # A swarm kept for later runs keeps its key: it seals the runs' signing keys.
        SWARMGRAD_SECRET_KEY=secret_key or secrets.token_urlsafe(48),
        SWARMGRAD_ADMIN_TOKEN=ADMIN,
        SWARMGRAD_REPORT_FLUSH_INTERVAL_S=str(flush_interval),
        SWARMGRAD_DB_POOL_SIZE="20",
        SWARMGRAD_PEER_AUTH_CACHE_TTL_S=str(auth_cache_ttl),
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from swarmgrad.cli import main; main()",
            "coordinator",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--workers",
            str(workers),
            "--log-level",
            "warning",
        ],
        env=env,
        cwd=REPO,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise SystemExit(f"coordinator exited with {process.returncode}")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit("coordinator did not start")
        time.sleep(0.1)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


async def setup_run(base: str, peers: int) -> tuple[str, list[str]]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=f"{base}/api/v1", timeout=60) as http:
        run = (
            await http.post("/runs", json={"name": "bench", "task": "none"}, headers=admin)
        ).json()
        # Every simulated peer joins with this one invite: it needs that many uses, and a few
        # more for joins retried. (The rate limits spare loopback clients, so the joins and
        # reports are not throttled.)
        invite = (
            await http.post(
                f"/runs/{run['id']}/tokens", json={"max_uses": peers + 100}, headers=admin
            )
        ).json()
        semaphore = asyncio.Semaphore(16)

        async def join(i: int) -> str:
            # On a loaded machine a keep-alive connection may be closed under a request:
            # join again, with a new key (the lost join may have happened).
            for attempt in range(5):
                try:
                    return await join_once(i)
                except httpx.TransportError:
                    if attempt == 4:
                        raise
                    await asyncio.sleep(1)
            raise AssertionError("unreachable")

        async def join_once(i: int) -> str:
            identity = Identity()
            invitee = {"Authorization": f"Bearer {invite['token']}"}
            async with semaphore:
                challenge = await http.post("/join/challenge", headers=invitee)
                challenge.raise_for_status()
                text = challenge.json()["challenge"]
                proof = identity.sign(join_proof_payload(run["id"], text, identity.public_key))
                response = await http.post(
                    f"/runs/{run['id']}/join",
                    json={
                        "public_key": _b64(identity.public_key),
                        "challenge": text,
                        "signature": _b64(proof),
                        "addresses": [f"ws://10.0.{i // 250}.{i % 250}:7000"],
                    },
                    headers=invitee,
                )
            response.raise_for_status()
            return response.json()["peer_token"]

        tokens = await asyncio.gather(*(join(i) for i in range(peers)))
    return run["id"], list(tokens)


async def _drive(
    base: str, path: str, tokens: list[str], concurrency: int, duration: float, report: bool
) -> tuple[int, int, list[float], float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    ok = errors = 0
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as http:
        start = time.perf_counter()
        deadline = start + duration

        async def worker(offset: int) -> None:
            nonlocal ok, errors
            i = offset
            epoch = 0
            while time.perf_counter() < deadline:
                token = tokens[i % len(tokens)]
                i += concurrency
                t0 = time.perf_counter()
                try:
                    if report:
                        epoch += 1
                        response = await http.post(
                            path,
                            json={
                                "epoch": epoch // 100,
                                "samples": epoch * 32,
                                "samples_per_second": 100.0,
                                "loss": 1.0 / epoch,
                                "group_size": min(8, len(tokens)),
                            },
                            headers={"Authorization": f"Bearer {token}"},
                        )
                        good = response.status_code == 202
                    else:
                        response = await http.get(path)
                        good = response.status_code == 200
                except httpx.HTTPError:
                    good = False
                latencies.append((time.perf_counter() - t0) * 1000)
                if good:
                    ok += 1
                else:
                    errors += 1

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - start
    return ok, errors, latencies, elapsed


async def _drive_raw(
    base: str, path: str, tokens: list[str], concurrency: int, duration: float, report: bool
) -> tuple[int, int, list[float], float]:
    """The same load through a minimal HTTP/1.1 keep-alive client on asyncio streams.

    httpx spends several milliseconds of CPU per request on this machine, so with the
    client and the server on the same two cores it, not the server, sets the pace. This
    client costs a small fraction of that, so the figures describe the server.
    """
    url = httpx.URL(base)
    host, port = url.host, url.port or 80
    ok = errors = 0
    latencies: list[float] = []
    start = time.perf_counter()
    deadline = start + duration

    def request(token: str, epoch: int) -> bytes:
        if not report:
            return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        body = (
            f'{{"epoch": {epoch // 100}, "samples": {epoch * 32}, "samples_per_second": 100.0, '
            f'"loss": {1.0 / (epoch + 1)}, "group_size": {min(8, len(tokens))}}}'
        ).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def connection(offset: int) -> None:
        nonlocal ok, errors
        reader, writer = await asyncio.open_connection(host, port)
        i, epoch = offset, 0
        try:
            while time.perf_counter() < deadline:
                token = tokens[i % len(tokens)]
                i += concurrency
                epoch += 1
                t0 = time.perf_counter()
                writer.write(request(token, epoch))
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append((time.perf_counter() - t0) * 1000)
                if status == (202 if report else 200):
                    ok += 1
                else:
                    errors += 1
        finally:
            writer.close()
            await writer.wait_closed()

    await asyncio.gather(*(connection(k) for k in range(concurrency)))
    return ok, errors, latencies, time.perf_counter() - start


def _client_process(
    args: tuple[str, str, str, list[str], int, float, bool],
) -> tuple[int, int, list[float], float]:
    client, *rest = args
    drive_one = _drive_raw if client == "raw" else _drive
    return asyncio.run(drive_one(*rest))  # type: ignore[arg-type]


def drive(
    client: str,
    name: str,
    base: str,
    path: str,
    tokens: list[str],
    concurrency: int,
    duration: float,
    processes: int,
    report: bool,
) -> Result:
    per_process = max(1, concurrency // processes)
    chunks = [tokens[k::processes] or tokens for k in range(processes)]
    jobs = [(client, base, path, chunk, per_process, duration, report) for chunk in chunks]
    if processes == 1:
        outcomes = [_client_process(jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            outcomes = pool.map(_client_process, jobs)
    return Result(
        name,
        ok=sum(o[0] for o in outcomes),
        errors=sum(o[1] for o in outcomes),
        seconds=max(o[3] for o in outcomes),
        latencies_ms=[x for o in outcomes for x in o[2]],
    )


def stored_reports(database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return connection.scalar(select(func.count()).select_from(ProgressReport)) or 0
    finally:
        engine.dispose()


def _schema_url(postgres_url: str, schema: str) -> str:
    return (
        make_url(postgres_url)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )


def _database(
    backend: str, args: argparse.Namespace, *, keep: bool = False
) -> tuple[str, Callable[[], None]]:
    """A fresh database for one backend: a SQLite file in a temporary directory, or a new
    schema of the PostgreSQL database at ``--postgres-url``; and what removes it (``keep``:
    what leaves the schema in place)."""
    tmp = tempfile.TemporaryDirectory(prefix="swarmgrad-bench-")
    if backend == "sqlite":
        return f"sqlite:///{tmp.name}/coordinator.db", tmp.cleanup
    schema = f"bench_{secrets.token_hex(4)}"
    admin = create_engine(args.postgres_url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))

    def cleanup() -> None:
        if not keep:
            with admin.begin() as connection:
                connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
        tmp.cleanup()

    return _schema_url(args.postgres_url, schema), cleanup


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")
    )


def bench_backend(backend: str, args: argparse.Namespace) -> None:
    url, cleanup = _database(backend, args)
    process, base = start_server(url, args.workers, args.flush_interval, args.auth_cache_ttl)
    try:
        run_id, tokens = asyncio.run(setup_run(base, args.peers))
        cpu_before = process_tree_cpu_seconds(process.pid)
        baseline = drive(
            args.client,
            "healthz",
            base,
            "/healthz",
            tokens,
            args.concurrency,
            args.duration / 2,
            args.client_processes,
            report=False,
        )
        cpu_middle = process_tree_cpu_seconds(process.pid)
        reports = drive(
            args.client,
            "reports",
            base,
            f"/api/v1/runs/{run_id}/reports",
            tokens,
            args.concurrency,
            args.duration,
            args.client_processes,
            report=True,
        )
        cpu_after = process_tree_cpu_seconds(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    stored = stored_reports(url)
    cpu_lines = ""
    if None not in (cpu_before, cpu_middle, cpu_after) and reports.ok and baseline.ok:
        per_report = (cpu_after - cpu_middle) / reports.ok * 1000  # type: ignore[operator]
        per_health = (cpu_middle - cpu_before) / baseline.ok * 1000  # type: ignore[operator]
        cpu_lines = (
            f"\n  server CPU per request: report {per_report:.2f} ms, healthz {per_health:.2f} ms"
            f"  -> at most {1000 / per_report:.0f} reports/s per core this server process tree gets"
        )
    print(
        f"{backend:<10} workers={args.workers} peers={args.peers} concurrency={args.concurrency} "
        f"auth-cache={args.auth_cache_ttl:g}s "
        f"client={args.client} x{args.client_processes}\n"
        f"  reports : {reports.rate:8.0f}/s  p50 {reports.quantile(0.5):6.1f} ms  p99 {reports.quantile(0.99):6.1f} ms  "
        f"errors {reports.errors}  accepted {reports.ok}  stored {stored}"
        f"{'' if stored == reports.ok else '  <-- MISMATCH'}\n"
        f"  healthz : {baseline.rate:8.0f}/s  p50 {baseline.quantile(0.5):6.1f} ms  p99 {baseline.quantile(0.99):6.1f} ms\n"
        f"  ratio reports/healthz: {reports.rate / baseline.rate:.2f}   "
        f"target 2000/s: {'reached' if reports.rate >= 2000 else 'NOT reached'}"
        f"{cpu_lines}",
        flush=True,
    )
    cleanup()


# --- Volunteers at their pace -------------------------------------------------------------
#
# The scenario above asks how fast the coordinator can take reports. This one asks whether it
# keeps up with a given swarm: ``--volunteers`` joined peers, each reporting once every
# ``--interval`` seconds (an open loop: a report is sent when it is due, whether or not the
# earlier ones were answered), while the other calls a run sees are served meanwhile:
# bootstrap and certificate renewals from the same volunteers, the dashboard's data, and its
# live feed watched over a WebSocket.


async def _drive_paced(
    base: str,
    path: str,
    tokens: list[str],
    connections: int,
    duration: float,
    interval: float,
    start_at: float,
) -> tuple[int, int, list[float], float, float]:
    """Each of ``tokens`` reports every ``interval`` s from ``start_at`` (wall clock, shared by
    the client processes) for ``duration`` s, over ``connections`` keep-alive connections.
    Returns accepted, refused, latencies (ms, from send to answer), the seconds the sending
    took and the worst lag behind schedule (s)."""
    url = httpx.URL(base)
    host, port = url.host, url.port or 80
    spacing = interval / len(tokens)
    total = max(1, int(duration / spacing))
    sent = [0] * len(tokens)
    state = {"next": 0, "ok": 0, "errors": 0, "lag": 0.0}
    latencies: list[float] = []

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while state["next"] < total:
                j = int(state["next"])
                state["next"] += 1
                delay = start_at + j * spacing - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    state["lag"] = max(state["lag"], -delay)
                k = j % len(tokens)
                sent[k] += 1
                n = sent[k]
                body = (
                    f'{{"epoch": {n // 100}, "samples": {n * 32}, '
                    f'"samples_per_second": {32 / interval:.3f}, "loss": {1.0 / n:.6f}, '
                    f'"group_size": {min(8, len(tokens))}}}'
                ).encode()
                t0 = time.perf_counter()
                writer.write(
                    f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {tokens[k]}"
                    f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append((time.perf_counter() - t0) * 1000)
                state["ok" if int(head[9:12]) == 202 else "errors"] += 1
        finally:
            writer.close()
            await writer.wait_closed()

    begin = time.time()
    await asyncio.gather(*(connection() for _ in range(connections)))
    seconds = time.time() - max(begin, start_at)
    return int(state["ok"]), int(state["errors"]), latencies, seconds, float(state["lag"])


def _paced_process(
    args: tuple[str, str, list[str], int, float, float, float],
) -> tuple[int, int, list[float], float, float]:
    return asyncio.run(_drive_paced(*args))


async def _side_load(
    base: str, run_id: str, tokens: list[str], rate: float, duration: float
) -> tuple[dict[str, Result], int]:
    """Bootstrap calls and certificate renewals from the volunteers, and the dashboard's data,
    each ``rate`` times a second (one at a time) for ``duration`` s."""
    calls: dict[str, tuple[str, str, int]] = {
        "bootstrap": ("GET", f"/api/v1/runs/{run_id}/bootstrap", 200),
        "certificate": ("POST", f"/api/v1/runs/{run_id}/certificate", 200),
        "dashboard": ("GET", f"/api/v1/runs/{run_id}/dashboard", 200),
    }
    results: dict[str, Result] = {}
    sizes: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:

        async def one(name: str) -> None:
            method, path, expected = calls[name]
            ok = errors = 0
            latencies: list[float] = []
            sent_at: list[float] = []
            start = time.perf_counter()
            i = 0
            while (due := i / rate) < duration and time.perf_counter() - start < duration:
                await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
                headers = (
                    {}
                    if name == "dashboard"
                    else {"Authorization": f"Bearer {tokens[i % len(tokens)]}"}
                )
                t0 = time.perf_counter()
                try:
                    answer = await http.request(method, path, headers=headers)
                    good = answer.status_code == expected
                    sizes[name] = len(answer.content)
                except httpx.HTTPError:
                    good = False
                latencies.append((time.perf_counter() - t0) * 1000)
                sent_at.append(t0 - start)
                ok, errors = ok + good, errors + (not good)
                i += 1
            seconds = time.perf_counter() - start
            results[name] = Result(name, ok, errors, seconds, latencies, sent_at)

        await asyncio.gather(*(one(name) for name in calls))
    return results, sizes.get("dashboard", 0)


PROBE_NAME = "live-feed probe"
PROBE_SAMPLES = 1_000_000  # far above what the simulated volunteers reach in a bench


async def _live_delays(base: str, run_id: str, token: str, duration: float) -> list[float]:
    """Seconds from a report's POST to the frame of the run's live dashboard that shows it,
    once a second: a WebSocket client of the feed stands in for the browser, and finds the
    probe volunteer's row in the volunteers' table of each frame."""
    from websockets.asyncio.client import connect

    delays: list[float] = []
    ws_url = base.replace("http://", "ws://") + f"/api/v1/runs/{run_id}/live"
    headers = {"Authorization": f"Bearer {token}"}

    def probe_samples(frame: dict[str, Any]) -> int | None:
        rows = frame.get("data", {}).get("volunteers", [])
        return next((r["samples"] for r in rows if r["display_name"] == PROBE_NAME), None)

    async with (
        httpx.AsyncClient(base_url=base, timeout=30) as http,
        connect(ws_url, max_size=None) as feed,
    ):
        # The current document. The probe's row changes only with the probe's reports: a
        # frame with another value than the last shows the report just sent (on a reused
        # swarm, the coordinator banks the counter it restarts from: a change all the same).
        shown = probe_samples(json.loads(await asyncio.wait_for(feed.recv(), 60)))
        end = time.perf_counter() + duration
        i = 0
        while time.perf_counter() < end - 1:
            i += 1
            report = {"epoch": 0, "samples": PROBE_SAMPLES + i, "samples_per_second": 10.0}
            start = time.perf_counter()
            try:
                answer = await http.post(
                    f"/api/v1/runs/{run_id}/reports", json=report, headers=headers
                )
            except httpx.TransportError:  # a keep-alive connection closed under it: again
                continue
            if answer.status_code != 202:
                raise SystemExit(f"the live-feed probe's report was refused: {answer.text}")
            while True:
                frame = json.loads(await asyncio.wait_for(feed.recv(), 60))
                value = probe_samples(frame) if frame.get("type") == "dashboard" else shown
                if value is not None and value != shown:
                    shown = value
                    break
            delays.append(time.perf_counter() - start)
            await asyncio.sleep(max(0.0, start + 1.0 - time.perf_counter()))
    return delays


def _live_process(args: tuple[str, str, str, float, float]) -> list[float]:
    base, run_id, token, duration, start_at = args

    async def watch() -> list[float]:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await _live_delays(base, run_id, token, duration)

    return asyncio.run(watch())


def database_bytes(url: str) -> int:
    """What the coordinator's tables and indexes take: the SQLite file and its WAL, or the
    PostgreSQL relations of the bench's schema."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = Path(parsed.database or "")
        return sum(p.stat().st_size for p in [path, Path(f"{path}-wal")] if p.exists())
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return int(
                connection.scalar(
                    text(
                        "SELECT coalesce(sum(pg_relation_size(c.oid)), 0) FROM pg_class c "
                        "JOIN pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE n.nspname = current_schema()"
                    )
                )
                or 0
            )
    finally:
        engine.dispose()


async def _paced_setup(base: str, volunteers: int) -> tuple[str, list[str], str]:
    """The run and its volunteers, and one more volunteer of the same run, named
    ``PROBE_NAME``, whose reports the live-feed probe follows."""
    run_id, tokens = await setup_run(base, volunteers)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=f"{base}/api/v1", timeout=60) as http:
        invite = (await http.post(f"/runs/{run_id}/tokens", json={}, headers=admin)).json()
        invitee = {"Authorization": f"Bearer {invite['token']}"}
        challenge = (await http.post("/join/challenge", headers=invitee)).json()["challenge"]
        identity = Identity()
        proof = identity.sign(join_proof_payload(run_id, challenge, identity.public_key))
        joined = await http.post(
            f"/runs/{run_id}/join",
            json={
                "public_key": _b64(identity.public_key),
                "challenge": challenge,
                "signature": _b64(proof),
                "addresses": [],
                "client_mode": True,
                "display_name": PROBE_NAME,
            },
            headers=invitee,
        )
        joined.raise_for_status()
    return run_id, tokens, joined.json()["peer_token"]


def _line(result: Result) -> str:
    return (
        f"  {result.name:<12}{result.rate:8.1f}/s  p50 {result.quantile(0.5):7.1f} ms  "
        f"p99 {result.quantile(0.99):7.1f} ms  errors {result.errors}"
    )


def bench_paced(backend: str, args: argparse.Namespace) -> bool:
    """Whether the goals held (p99 of reports and of the dashboard's data, every report
    acknowledged and stored, the schedule kept)."""
    swarm_file = Path(args.swarm_file) if args.swarm_file else None
    saved = json.loads(swarm_file.read_text()) if swarm_file and swarm_file.exists() else None
    if saved is not None:
        if backend != "postgresql" or len(saved["tokens"]) != args.volunteers:
            raise SystemExit(f"{swarm_file} holds {len(saved['tokens'])} volunteers on PostgreSQL")
        url, cleanup = _schema_url(args.postgres_url, saved["schema"]), lambda: None
    else:
        url, cleanup = _database(backend, args, keep=swarm_file is not None)
    secret_key = saved["secret_key"] if saved is not None else secrets.token_urlsafe(48)
    try:
        process, base = start_server(
            url, args.workers, args.flush_interval, args.auth_cache_ttl, secret_key
        )
        try:
            began = time.perf_counter()
            if saved is None:
                run_id, tokens, probe_token = asyncio.run(_paced_setup(base, args.volunteers))
                if swarm_file is not None:
                    schema = make_url(url).query["options"].split("=", 1)[1]
                    swarm_file.write_text(
                        json.dumps(
                            {
                                "schema": schema,
                                "run_id": run_id,
                                "tokens": tokens,
                                "probe_token": probe_token,
                                "secret_key": secret_key,
                            }
                        )
                    )
            else:
                run_id, tokens = saved["run_id"], saved["tokens"]
                probe_token = saved["probe_token"]
            joined_s = time.perf_counter() - began
            stored_before = stored_reports(url)
            size_before = database_bytes(url)
            cpu_before = process_tree_cpu_seconds(process.pid)
            processes = max(1, min(args.client_processes, len(tokens)))
            start_at = time.time() + 2.0 + processes  # the processes start meanwhile
            per = max(1, args.concurrency // processes)
            jobs = [
                (
                    base,
                    f"/api/v1/runs/{run_id}/reports",
                    tokens[p::processes],
                    per,
                    args.duration,
                    args.interval,
                    start_at + p * args.interval / len(tokens),
                )
                for p in range(processes)
            ]
            context = multiprocessing.get_context("spawn")
            # The live-feed probe parses every frame (megabytes with thousands of
            # volunteers): a process of its own, so that it delays no other measurement.
            with context.Pool(processes) as pool, context.Pool(1) as probe:
                pending = pool.map_async(_paced_process, jobs)
                watching = probe.apply_async(
                    _live_process, ((base, run_id, probe_token, args.duration, start_at),)
                )

                async def beside() -> tuple[dict[str, Result], int]:
                    await asyncio.sleep(max(0.0, start_at - time.time()))
                    return await _side_load(base, run_id, tokens, args.side_rate, args.duration)

                side, side_bytes = asyncio.run(beside())
                outcomes = pending.get()
                live = watching.get()
            cpu_after = process_tree_cpu_seconds(process.pid)
            load = os.getloadavg()[0]
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
        size_after = database_bytes(url)
        stored = stored_reports(url) - stored_before
    finally:
        cleanup()
    reports = Result(
        "reports",
        ok=sum(o[0] for o in outcomes),
        errors=sum(o[1] for o in outcomes),
        seconds=max(o[3] for o in outcomes),
        latencies_ms=[x for o in outcomes for x in o[2]],
    )
    lag = max(o[4] for o in outcomes)
    expected_stored = reports.ok + len(live)
    growth = (size_after - size_before) / reports.seconds * 3600
    report_p99 = reports.quantile(0.99)
    steady = {name: result.after(args.warmup) for name, result in side.items()}
    dashboard_p99 = steady["dashboard"].quantile(0.99)
    held = (
        report_p99 < GOAL_REPORT_P99_MS
        and dashboard_p99 < GOAL_DASHBOARD_P99_MS
        and reports.errors == 0
        and stored == expected_stored
        and lag < args.interval
    )
    goal_rate = args.volunteers / args.interval
    cpu_line = ""
    if cpu_before is not None and cpu_after is not None and reports.ok:
        cpu = cpu_after - cpu_before
        cpu_line = (
            f"  coordinator CPU: {cpu / reports.seconds:.2f} cores over the run "
            f"({cpu / reports.ok * 1000:.2f} ms per report, everything else included; "
            f"PostgreSQL's own not counted); load average {load:.1f} on "
            f"{os.cpu_count()} CPUs\n"
        )
    print(
        f"{backend:<10} volunteers={args.volunteers} every {args.interval:g} s "
        f"(due {goal_rate:.0f} reports/s) workers={args.workers} "
        f"connections={per * processes} client processes={processes}; "
        + (
            f"joined (with proof of possession) in {joined_s:.0f} s\n"
            if saved is None
            else f"the swarm of {swarm_file} (joined before)\n"
        )
        + f"{_line(reports)}  accepted {reports.ok}  stored {stored - len(live)}"
        f"{'' if stored == expected_stored else '  <-- MISMATCH'}\n"
        f"  worst lag behind the schedule: {lag * 1000:.0f} ms\n"
        f"{cpu_line}"
        + "\n".join(
            f"{_line(steady[name])}  (slowest after: {steady[name].slowest()}; "
            f"first {args.warmup:g} s: worst {side[name].worst_before(args.warmup):.0f} ms)"
            for name in ("bootstrap", "certificate", "dashboard")
        )
        + f"\n  report → live dashboard (a WebSocket client of the feed): "
        f"p50 {statistics.median(live) * 1000:.0f} ms, p99 {percentile(live, 0.99) * 1000:.0f} ms "
        f"over {len(live)} reports; dashboard document {side_bytes / 1e6:.2f} MB\n"
        f"  database: {size_before / 1e6:.1f} MB after the joins, {size_after / 1e6:.1f} MB after "
        f"{reports.seconds:.0f} s -> {growth / 1e6:.0f} MB per hour "
        f"({(size_after - size_before) / max(1, reports.ok):.0f} bytes per report; raw reports "
        f"older than SWARMGRAD_REPORT_RETENTION_S are folded away)\n"
        f"  goals (reports p99 < {GOAL_REPORT_P99_MS:.0f} ms, dashboard p99 < "
        f"{GOAL_DASHBOARD_P99_MS:.0f} ms after the first {args.warmup:g} s, schedule kept, "
        "all stored): "
        f"{'held' if held else 'NOT held'}",
        flush=True,
    )
    return held


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--peers", type=int, default=1000, help="Simulated peers (joined first).")
    parser.add_argument("--duration", type=float, default=10.0, help="Seconds of load per backend.")
    parser.add_argument("--concurrency", type=int, default=32, help="Requests in flight.")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes.")
    parser.add_argument("--client-processes", type=int, default=1, help="Load-generator processes.")
    parser.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="Load generator: a minimal HTTP/1.1 client (default; cheap) or httpx.",
    )
    parser.add_argument(
        "--flush-interval", type=float, default=0.05, help="SWARMGRAD_REPORT_FLUSH_INTERVAL_S"
    )
    parser.add_argument(
        "--auth-cache-ttl",
        type=float,
        default=600.0,
        help="SWARMGRAD_PEER_AUTH_CACHE_TTL_S (0: every report is checked in the database)",
    )
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES)
    parser.add_argument(
        "--volunteers",
        type=int,
        default=0,
        help="Instead of the fastest rate: this many volunteers, each reporting every "
        "--interval s, with bootstrap, certificate renewals, the dashboard and its live feed "
        "served meanwhile.",
    )
    parser.add_argument(
        "--interval", type=float, default=10.0, help="Seconds between one volunteer's reports."
    )
    parser.add_argument(
        "--side-rate",
        type=float,
        default=1.0,
        help="Bootstrap calls, certificate renewals and dashboard reads per second (each).",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=10.0,
        help="With --volunteers: the side calls (bootstrap, certificate, dashboard) sent in the "
        "first S seconds are the cold start (each worker's first connections, token cache and "
        "document builds): their worst is printed apart and the percentiles are taken over "
        "the rest.",
    )
    parser.add_argument(
        "--swarm-file",
        default=None,
        help="With --volunteers on PostgreSQL: keep the joined swarm (its schema, run and "
        "tokens) and name it in this JSON file; a later run given the same file reuses it "
        "instead of joining again (10,000 joins take minutes). Drop the schema by hand after.",
    )
    args = parser.parse_args()
    if args.volunteers < 0 or args.interval <= 0 or args.side_rate <= 0:
        parser.error("volunteers >= 0, interval > 0 and side-rate > 0")
    if (
        not 1 <= args.peers <= 100_000
        or not 0 < args.duration <= 600
        or not 1 <= args.concurrency <= 1024
    ):
        parser.error("peers in [1, 100000], duration in (0, 600] s, concurrency in [1, 1024]")
    print(f"coordinator load: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}", flush=True)
    for backend in ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]:
        if args.volunteers:
            bench_paced(backend, args)
        else:
            bench_backend(backend, args)


if __name__ == "__main__":
    main()
