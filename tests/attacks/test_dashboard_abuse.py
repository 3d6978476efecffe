"""Reading the public dashboard to make the coordinator work, through a real coordinator
process: one full build per request with a new ``q``, other runs pushed out of the cache,
and no bound on how often one client reads.

Guards two defences. The dashboard cache keyed by run only (``cached_run_dashboard`` in
:mod:`server.api.routes.dashboard`, which the public HTML page uses too): keyed by the
query, as it was, every distinct ``q`` built a whole dashboard (headline, charts, history)
and 300 of them evicted the honest run's document; the HTML page built one per request. And the per-address limit on dashboard reads (``Endpoint.DASHBOARD``,
``rate_limit_dashboard_*``): without it, one address's reads are all answered.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.attacks.conftest import Attack, CoordinatorFactory

pytestmark = pytest.mark.slow

BURST = 20
PEERS_ONLINE = re.compile(r'data-metric="peers_online">(\d+)<')


def test_distinct_queries_force_no_builds(
    attack: Attack, start_coordinator: CoordinatorFactory
) -> None:
    """Distinct dashboard queries, each a build, pushing runs out of the cache"""
    # A long cache age: a document built again within the test is one the cache lost.
    coordinator = start_coordinator(SWARMGRAD_DASHBOARD_CACHE_S="60")
    honest_run = coordinator.create_run(name="honest")
    attacked_run = coordinator.create_run(name="attacked")
    invite = coordinator.invite(attacked_run)
    coordinator.join(attacked_run, invite, display_name="ada")

    def dashboard(run_id: str, **query: Any) -> dict[str, Any]:
        answer = coordinator.http.get(f"/api/v1/runs/{run_id}/dashboard", params=query)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    honest = dashboard(honest_run)
    attacked = dashboard(attacked_run)
    # From loopback (exempt from rate limits): only the cache's keying stands in the way.
    answers = [dashboard(attacked_run, q=f"x{i}") for i in range(300)]
    built_at = {a["now"] for a in answers}
    assert built_at == {attacked["now"]}, f"{len(built_at)} builds for 300 queries"
    assert all(a["volunteers"] == [] and a["volunteers_page"]["q"] for a in answers)
    assert [v["display_name"] for v in dashboard(attacked_run, q="ad")["volunteers"]] == ["ada"]
    attack.outcome("300 distinct queries: no dashboard build (each a table query), filters exact")
    assert dashboard(honest_run)["now"] == honest["now"]
    attack.effect("the other run's cached document still served (built once)")

    # The public HTML page likewise: its headline from the cached document, its table now.
    def page(**query: Any) -> tuple[int, str]:
        answer = coordinator.http.get(f"/runs/{attacked_run}", params=query)
        assert answer.status_code == 200
        online = PEERS_ONLINE.search(answer.text)
        assert online, answer.text
        return int(online.group(1)), answer.text

    assert page()[0] == 1
    coordinator.join(attacked_run, invite, display_name="bob")
    online, text = page(q="bo")
    assert online == 1 and ">bob<" in text  # not rebuilt for the query; the table is current
    attack.outcome("the run's HTML page with a new query: no build either")


def test_one_address_reads_the_dashboard_without_limit(
    attack: Attack, start_coordinator: CoordinatorFactory
) -> None:
    """One address floods the dashboard's data and pages"""
    coordinator = start_coordinator(
        SWARMGRAD_RATE_LIMIT_DASHBOARD_BURST=str(BURST),
        SWARMGRAD_RATE_LIMIT_DASHBOARD_PER_S="0.5",
    )
    run_id = coordinator.create_run()
    # Behind a proxy on loopback that names the client (loopback itself is exempt).
    flooder = {"X-Forwarded-For": "198.51.100.7"}
    paths = [
        "/api/v1/dashboard",
        f"/api/v1/runs/{run_id}/dashboard?q=a",
        f"/api/v1/runs/{run_id}/volunteers?q=b",
        f"/api/v1/runs/{run_id}/volunteers/1",
        f"/runs/{run_id}?q=c",
        "/",
    ]
    statuses = [
        coordinator.http.get(paths[i % len(paths)], headers=flooder).status_code
        for i in range(3 * BURST)
    ]
    answered = [s for s in statuses if s != 429]
    assert len(answered) == BURST, statuses
    refused = coordinator.http.get(f"/api/v1/runs/{run_id}/dashboard", headers=flooder)
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert "too many dashboard requests from this address" in refused.json()["detail"]
    attack.outcome(
        f"{statuses.count(429)} of {len(statuses)} reads refused with 429 after the burst "
        f"of {BURST}, over the API and the pages alike"
    )
    viewer = {"X-Forwarded-For": "203.0.113.9"}
    for path in paths:
        assert coordinator.http.get(path, headers=viewer).status_code in (200, 404), path
    attack.effect("a viewer at another address reads every page and document")
