"""The dashboard's cost as a run grows, and the delay from a report to an open page.

1. A run with ``--peers`` simulated peers (rows written straight into a fresh SQLite file) and
   a growing history of raw reports (and one progress snapshot per ``--reports-per-snapshot``
   reports, as the report flush writes them). At each size in ``--sizes`` it times
   ``GET /api/v1/runs/{id}/dashboard`` through the app in this process (httpx's ASGI
   transport: the route, the queries and the JSON, without a socket), and
   ``GET /healthz`` the same way as the reference: the ratio is the figure that survives a
   change of machine, and it must not grow with the number of stored reports.
2. A real uvicorn on loopback, a WebSocket on the run's live feed, and ``--live-reports``
   reports posted one by one: the time from each POST to the frame that shows it.

    python bench/dashboard.py                                  # 1,000 peers, 10k/100k/1M
    python bench/dashboard.py --peers 50 --sizes 1000,5000 --requests 20 --live-reports 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from peer.formats.identity import Identity, join_proof_payload  # noqa: E402
from server.app import create_app  # noqa: E402
from server.clock import now_ms  # noqa: E402
from server.config import Settings  # noqa: E402

ADMIN = "bench-admin-" + secrets.token_urlsafe(32)
GOAL_P99_MS = 50.0
GOAL_DELAY_S = 2.0


def settings_for(directory: Path) -> Settings:
    return Settings(
        environment="production",
        database_url=f"sqlite:///{directory / 'bench.db'}",
        secret_key=secrets.token_urlsafe(48),
        admin_token=ADMIN,
        checkpoint_dir=directory / "checkpoints",
        # What a build costs: every request builds (the REST cache would answer most).
        dashboard_cache_s=0,
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def timed(client: httpx.AsyncClient, path: str, requests: int) -> list[float]:
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        answer = await client.get(path)
        times.append((time.perf_counter() - start) * 1000)
        answer.raise_for_status()
    return times


def seed_peers(engine: Any, run_id: str, peers: int) -> list[int]:
    """``peers`` volunteers with one peer each, online; their primary keys."""
    from sqlalchemy import insert, select

    from server.models import Peer, Volunteer, utcnow

    now = now_ms()
    with engine.begin() as connection:
        connection.execute(
            insert(Volunteer),
            [
                {"run_id": run_id, "display_name": f"volunteer {i}", "created_at": utcnow()}
                for i in range(peers)
            ],
        )
        volunteers = connection.execute(
            select(Volunteer.id).where(Volunteer.run_id == run_id)
        ).scalars()
        connection.execute(
            insert(Peer),
            [
                {
                    "run_id": run_id,
                    "peer_id": f"{i:064x}",
                    "public_key": i.to_bytes(32, "big"),
                    "volunteer_id": v,
                    "addresses": [f"ws://10.0.{i // 250}.{i % 250}:7000"],
                    "client_mode": i % 5 == 0,
                    "first_seen_ms": now - 3_600_000,
                    "last_seen_ms": now,
                    "last_report_ms": now,
                    "session_started_ms": now - 3_600_000,
                    "epoch": 100,
                    "samples": 10_000 + i,
                    "samples_per_second": 30.0,
                    "loss": 1.0 + i / peers,
                    "group_size": 4,
                }
                for i, v in enumerate(volunteers)
            ],
        )
        return list(connection.execute(select(Peer.id).where(Peer.run_id == run_id)).scalars())


def grow_reports(
    engine: Any, run_id: str, peers: list[int], start: int, stop: int, per_snapshot: int
) -> None:
    """Raw reports ``start`` to ``stop`` (and their snapshots), oldest first, 100 ms apart."""
    from sqlalchemy import insert

    from server.models import ProgressReport, ProgressSnapshot

    base = now_ms() - 100 * 1_000_000
    batch = 50_000
    with engine.begin() as connection:
        for first in range(start, stop, batch):
            last = min(stop, first + batch)
            connection.execute(
                insert(ProgressReport),
                [
                    {
                        "run_id": run_id,
                        "peer_id": peers[n % len(peers)],
                        "reported_ms": base + 100 * n,
                        "epoch": n // 10_000,
                        "samples": n,
                        "samples_per_second": 30.0,
                        "loss": 2.0 - n / 1_000_000,
                        "group_size": 2 + n % 4,
                        "rounds_done": 1,
                        "rounds_failed": int(n % 17 == 0),
                    }
                    for n in range(first, last)
                ],
            )
        snapshots = range(start // per_snapshot, stop // per_snapshot)
        if snapshots:
            connection.execute(
                insert(ProgressSnapshot),
                [
                    {
                        "run_id": run_id,
                        "taken_ms": base + 100 * s * per_snapshot,
                        "epoch": s * per_snapshot // 10_000,
                        "samples": s * per_snapshot * 32,
                        "samples_per_second": 30.0 * len(peers),
                        "loss": 2.0 - s / 10_000,
                        "peers_online": len(peers),
                        "mean_group_size": 3.5,
                        "rounds_done": s * per_snapshot,
                        "rounds_failed": s * per_snapshot // 17,
                    }
                    for s in snapshots
                ],
            )


async def scaling(
    args: argparse.Namespace, directory: Path
) -> list[tuple[int, float, float, float]]:
    from server.db import make_engine

    settings = settings_for(directory)
    app = create_app(settings)
    rows = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            run = (
                await client.post(
                    "/api/v1/runs",
                    json={"name": "bench", "task": "digits", "config": {"epochs": 1000}},
                    headers={"Authorization": f"Bearer {ADMIN}"},
                )
            ).json()
            engine = make_engine(settings)
            peers = seed_peers(engine, run["id"], args.peers)
            stored = 0
            print(f"run with {args.peers:,} peers; {args.requests} requests per size")
            print(
                f"{'reports':>10} {'p50 ms':>8} {'p99 ms':>8} {'healthz p50':>12} {'p50/healthz':>12}"
            )
            for size in args.sizes:
                grow_reports(engine, run["id"], peers, stored, size, args.reports_per_snapshot)
                stored = size
                path = f"/api/v1/runs/{run['id']}/dashboard"
                await timed(client, path, 3)  # warm the caches
                dashboard = await timed(client, path, args.requests)
                reference = await timed(client, "/healthz", args.requests)
                p50, p99, ref = (
                    statistics.median(dashboard),
                    percentile(dashboard, 0.99),
                    statistics.median(reference),
                )
                rows.append((size, p50, p99, ref))
                print(f"{size:>10,} {p50:>8.2f} {p99:>8.2f} {ref:>12.2f} {p50 / ref:>12.1f}")
            engine.dispose()
    first = rows[0]
    print(
        f"p99 at {rows[-1][0]:,} reports: {rows[-1][2]:.1f} ms (goal < {GOAL_P99_MS:.0f} ms); "
        f"p50/healthz ratio at the largest size / at the smallest: "
        f"{(rows[-1][1] / rows[-1][3]) / (first[1] / first[3]):.2f} (flat is 1)"
    )
    return rows


def live_delay(args: argparse.Namespace, directory: Path) -> list[float]:
    import uvicorn
    from websockets.sync.client import connect

    settings = settings_for(directory / "live")
    (directory / "live").mkdir()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the coordinator did not start")
        time.sleep(0.05)  # startup poll: uvicorn has no readiness callback
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    organizer = {"Authorization": f"Bearer {ADMIN}"}
    delays = []
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            run = client.post(
                "/api/v1/runs", json={"name": "live", "task": "digits"}, headers=organizer
            ).json()
            invite = client.post(f"/api/v1/runs/{run['id']}/tokens", json={}, headers=organizer)
            token = {"Authorization": f"Bearer {invite.json()['token']}"}
            challenge = client.post("/api/v1/join/challenge", headers=token).json()["challenge"]
            identity = Identity()
            import base64

            def b64(data: bytes) -> str:
                return base64.urlsafe_b64encode(data).decode()

            body = {
                "public_key": b64(identity.public_key),
                "challenge": challenge,
                "signature": b64(
                    identity.sign(join_proof_payload(run["id"], challenge, identity.public_key))
                ),
                "addresses": [],
                "client_mode": True,
            }
            peer = client.post(f"/api/v1/runs/{run['id']}/join", json=body, headers=token).json()
            headers = {"Authorization": f"Bearer {peer['peer_token']}"}
            with connect(f"ws://127.0.0.1:{port}/api/v1/runs/{run['id']}/live") as websocket:
                websocket.recv(timeout=10)  # the current document
                for i in range(1, args.live_reports + 1):
                    report = {"epoch": 1, "samples": 100 * i, "samples_per_second": 10.0}
                    start = time.perf_counter()
                    client.post(f"/api/v1/runs/{run['id']}/reports", json=report, headers=headers)
                    while True:
                        frame = json.loads(websocket.recv(timeout=10))
                        if frame.get("data", {}).get("headline", {}).get("samples") == 100 * i:
                            break
                    delays.append(time.perf_counter() - start)
    finally:
        server.should_exit = True
        thread.join(10)
    print(
        f"report → live page: p50 {statistics.median(delays) * 1000:.0f} ms, "
        f"p99 {percentile(delays, 0.99) * 1000:.0f} ms over {len(delays)} reports "
        f"(goal < {GOAL_DELAY_S:.0f} s; the feed rereads the database every "
        f"{settings.live_interval_s} s, reports are flushed every "
        f"{settings.report_flush_interval_s} s)"
    )
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument(
        "--sizes",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[10_000, 100_000, 1_000_000],
        help="stored reports at which to measure, comma-separated, increasing",
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--reports-per-snapshot", type=int, default=1000)
    parser.add_argument("--live-reports", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarmgrad-bench-dashboard-") as temp:
        asyncio.run(scaling(args, Path(temp)))
        live_delay(args, Path(temp))


if __name__ == "__main__":
    main()
