"""Chaos: one volunteer with a real peer token turns hostile while two honest ones report.

It resets its counter over and over, claims absurd samples, rates and epochs, floods the
report endpoint and the join endpoint. The honest volunteers' totals stay exactly their own
counts, every refusal of the offender reaches the organizer (the peers list), the offender is
rate-limited, and the run's epoch stays where the honest swarm allows.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx

from server.app import create_app
from server.services.report_bounds import SAMPLES_GRACE_S
from tests.server.conftest import ORGANIZER, Api, JoinedPeer, bearer, make_settings, running
from tests.server.test_rate_limits import client_from, loopback, refused_count

HONEST = ("203.0.113.10", "203.0.113.11")
OFFENDER = "198.51.100.66"
MAX_RATE = 100.0  # samples/s any one peer may claim
LEAD = 2  # epochs past the swarm's
REPORT_BURST = 80  # the rounds below take 70
ROUNDS = 10
HONEST_SAMPLES = ROUNDS * 50
HONEST_EPOCH = (ROUNDS - 1) // 4


async def test_a_hostile_volunteer_among_honest_ones(tmp_path: Path) -> None:
    settings = make_settings(
        f"sqlite:///{tmp_path / 'coordinator.db'}",
        peer_auth_cache_ttl_s=3600,  # 429s are counted against a peer whose token is known
        report_max_samples_per_second=MAX_RATE,
        report_max_epoch_lead=LEAD,
        rate_limit_reports_per_s=0.5,
        rate_limit_reports_burst=REPORT_BURST,
        rate_limit_join_per_s=0.5,
        rate_limit_join_burst=5,
    )
    async with running(create_app(settings)) as app, loopback(app) as organizer:
        run = await Api(organizer).create_run()
        invite = (await Api(organizer).create_join_token(run["id"], max_uses=100))["token"]
        clients = [client_from(app, host) for host in (*HONEST, OFFENDER)]
        try:
            apis = [Api(c) for c in clients]
            peers = [await api.join(run["id"], invite) for api in apis]
            tally, joins_refused = await attack(run["id"], apis, peers, invite)
        finally:
            for client in clients:
                await client.aclose()
        await app.state.report_buffer.flush()
        listed = (await organizer.get(f"/api/v1/runs/{run['id']}/peers", headers=ORGANIZER)).json()
        progress = (
            await organizer.get(f"/api/v1/runs/{run['id']}/progress", headers=ORGANIZER)
        ).json()
        metrics = (await organizer.get("/metrics")).text

    by_id = {p["peer_id"]: p for p in listed["peers"]}
    honest = [by_id[p.body["peer_id"]] for p in peers[:2]]
    offender = by_id[peers[2].body["peer_id"]]
    # The honest volunteers' totals are exactly what they counted, and nothing of theirs
    # was refused.
    assert [p["samples"] for p in honest] == [HONEST_SAMPLES, HONEST_SAMPLES]
    assert [p["reports_refused"] for p in honest] == [0, 0]
    # The offender's total stays within what the rate allows since it joined; the run's is
    # the sum of what is listed.
    assert offender["samples"] <= MAX_RATE * (SAMPLES_GRACE_S + 60)
    assert progress["samples"] == sum(p["samples"] for p in listed["peers"])
    # Every refusal of the offender — bounds (422) and rate limits (429) — reaches the
    # organizer, the last one named.
    assert tally[422] >= 6 and tally[429] > 0
    assert offender["reports_refused"] == tally[422] + tally[429]
    assert offender["last_refusal"] == "rate_limit:reports"
    assert refused_count(metrics, "reports", "peer") == tally[429]
    assert refused_count(metrics, "join_challenge", "address") == joins_refused
    # The run's epoch: the honest swarm's, plus at most the lead the bound allows.
    assert HONEST_EPOCH <= progress["epoch"] <= HONEST_EPOCH + LEAD


async def attack(
    run_id: str, apis: list[Api], peers: list[JoinedPeer], invite: str
) -> tuple[Counter[int], int]:
    """Rounds of honest reports with the offender's tricks in between, then its floods.
    Returns the statuses the offender's reports got and how many of its joins were refused."""
    outcomes: Counter[int] = Counter()
    hostile, offender = apis[2], peers[2]

    async def bad(**body: object) -> httpx.Response:
        response = await hostile.report(run_id, offender, **body)
        assert response.status_code in (202, 422, 429), response.text
        outcomes[response.status_code] += 1
        return response

    for round_ in range(ROUNDS):
        epoch = round_ // 4
        for api, peer in zip(apis[:2], peers[:2], strict=True):
            honest = await api.report(
                run_id, peer, epoch=epoch, samples=(round_ + 1) * 50, samples_per_second=10.0
            )
            assert honest.status_code == 202, honest.text
        # Counter resets: each banks what the counter had, until the lifetime bound says no.
        await bad(epoch=epoch, samples=int(MAX_RATE * SAMPLES_GRACE_S * 0.9))
        await bad(epoch=epoch, samples=0)
        # Absurd claims, every round.
        assert (await bad(epoch=epoch, samples=10**15)).status_code == 422
        assert (await bad(epoch=epoch, samples_per_second=1e12)).status_code == 422
        assert (await bad(epoch=10**9)).status_code == 422
        # Climbing: as far as the lead allows past the others, never further.
        assert (await bad(epoch=epoch + LEAD + 1)).status_code == 422
        assert (await bad(epoch=epoch + LEAD)).status_code == 202
    assert outcomes[429] == 0  # all of that within the burst
    # A flood of reports: the peer's bucket runs dry.
    for _ in range(REPORT_BURST):
        await bad(epoch=HONEST_EPOCH)
    # A flood of joins from its address: refused past the burst, others still join.
    statuses: Counter[int] = Counter()
    for _ in range(20):
        challenge = await hostile.client.post("/api/v1/join/challenge", headers=bearer(invite))
        statuses[challenge.status_code] += 1
    assert statuses[429] >= 10 and set(statuses) <= {200, 429}, statuses
    await apis[0].join(run_id, invite)  # another address is not held up
    return outcomes, statuses[429]
