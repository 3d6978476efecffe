"""An IPv6 subscriber multiplies the per-address limits by moving between the /64s of its
own prefix, through a real coordinator process (behind a proxy on loopback, which names the
client in ``X-Forwarded-For``).

Guards ``rate_limit_ipv6_prefix`` (a /56 by default) in
:func:`server.services.rate_limits.address_key`: counted per /64 instead, each of the 256
/64s of the attacker's /56 gets a bucket of its own and every challenge below is answered.
"""

from __future__ import annotations

import ipaddress

import pytest

from tests.attacks.conftest import Attack, CoordinatorFactory
from tests.server.conftest import bearer

pytestmark = pytest.mark.slow

BURST = 5


def test_ipv6_subscriber_rotates_its_64s(
    attack: Attack, start_coordinator: CoordinatorFactory
) -> None:
    """An IPv6 subscriber rotates through the /64s of its /56"""
    coordinator = start_coordinator(
        SWARMGRAD_RATE_LIMIT_JOIN_BURST=str(BURST), SWARMGRAD_RATE_LIMIT_JOIN_PER_S="0.01"
    )
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    subscriber = ipaddress.IPv6Network("2001:db8:aa:ff00::/56")

    def challenge(address: ipaddress.IPv6Address) -> int:
        answer = coordinator.http.post(
            "/api/v1/join/challenge",
            headers={**bearer(invite), "X-Forwarded-For": str(address)},
        )
        return answer.status_code

    # One address in each of 4 * BURST different /64s of the subscriber's /56.
    lans = list(subscriber.subnets(new_prefix=64))[: 4 * BURST]
    answers = [challenge(lan[1]) for lan in lans]
    assert answers[:BURST] == [200] * BURST
    assert set(answers[BURST:]) == {429}, answers
    attack.outcome(
        f"{answers.count(429)} of {len(lans)} join challenges from distinct /64s of one /56 "
        f"refused with 429 after the burst of {BURST}"
    )
    neighbour = ipaddress.IPv6Network("2001:db8:aa:fe00::/56")
    assert challenge(neighbour[1]) == 200
    attack.effect("a subscriber in the next /56 is answered")

    per_48 = start_coordinator(
        SWARMGRAD_RATE_LIMIT_JOIN_BURST=str(BURST),
        SWARMGRAD_RATE_LIMIT_JOIN_PER_S="0.01",
        SWARMGRAD_RATE_LIMIT_IPV6_PREFIX="48",
    )
    invite = per_48.invite(per_48.create_run())
    statuses = [
        per_48.http.post(
            "/api/v1/join/challenge",
            headers={**bearer(invite), "X-Forwarded-For": str(network[1])},
        ).status_code
        for network in list(ipaddress.IPv6Network("2001:db8:bb::/48").subnets(new_prefix=56))[
            : BURST + 1
        ]
    ]
    assert statuses == [200] * BURST + [429], statuses
    attack.outcome("SWARMGRAD_RATE_LIMIT_IPV6_PREFIX=48 counts a whole /48 as one client")
