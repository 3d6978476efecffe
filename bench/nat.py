"""Volunteers behind home routers against the same volunteers behind plain routers, measured.

    .venv/bin/python bench/nat.py [--runs 3] [--seconds 60] [--rate 50] [--rtt 50]

Runs the swarm of the NAT scenario (:mod:`swarmlab.natrun`: a coordinator and a relay on
the public side, six ``swarmgrad join`` behind two endpoint-independent routers, two
symmetric ones, one that blocks UDP and one with UPnP/NAT-PMP; needs root, nftables and
miniupnpd) and the same six behind routers that forward every port to them (reachable:
plain ``ws://`` links, the relay unused), each volunteer on a ``--rate`` Mbit/s, ``--rtt``
ms home link, the digits task gathering groups for 2 s (as the scenario's test). Once
every volunteer has averaged, it counts the swarm's averaging rounds over ``--seconds`` (the coordinator's
``rounds_done``, from the volunteers' reports) and, for the NAT swarm, the bytes the relay
carried against the bytes all volunteers sent (their reported ``bytes_per_sample`` times
their samples) over the same window. It prints, per run, the rounds per second of each
swarm, their ratio (NAT over plain; goal at least 0.8) and the relay's share of the bytes;
then the median and the spread of the ratio over ``--runs`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarmlab.natlab import Link, RouterKind, unavailable  # noqa: E402
from swarmlab.natrun import NatRun  # noqa: E402
from swarmlab.node_process import wait_until  # noqa: E402

NAT = [
    RouterKind.EIM,
    RouterKind.EIM,
    RouterKind.SYMMETRIC,
    RouterKind.SYMMETRIC,
    RouterKind.UDP_BLOCKED,
    RouterKind.PORT_MAPPING,
]
PLAIN = [RouterKind.FORWARDED] * len(NAT)
# as the NAT scenario's test: groups gathered for 2 s over the home links (the digits task's
# 0.5 s is for loopback)
CONFIG = ["epochs=100000", "matchmaking_time=2"]


def measure(kinds: list[RouterKind], link: Link, seconds: float) -> dict[str, float]:
    """One swarm behind ``kinds``: rounds per second over ``seconds`` once every volunteer
    averaged, and the bytes the relay carried and all volunteers sent over that window."""
    with (
        tempfile.TemporaryDirectory(prefix="sgnatbench-") as directory,
        NatRun(kinds, Path(directory), link=link, config=CONFIG) as run,
    ):
        volunteers = run.join_all()

        def all_averaging() -> bool:
            return all(
                any(size is not None and size > 1 for size in v.groups().values())
                for v in volunteers
            )

        if not wait_until(all_averaging, 600):
            alone = [
                f"volunteer {k}: {v.lines[-1] if v.lines else 'no output'}"
                for k, v in enumerate(volunteers)
                if not any(size is not None and size > 1 for size in v.groups().values())
            ]
            kinds_shown = [k.value for k in kinds]
            raise SystemExit(f"the swarm behind {kinds_shown} never averaged: {alone}")

        def sample() -> tuple[float, float, float, float]:
            progress = run.progress()
            sent = (progress.get("bytes_per_sample") or 0.0) * progress["samples"]
            relayed = run.relay_stats().get("bytes_carried", 0)
            return time.monotonic(), progress["rounds_done"], sent, relayed

        start = sample()
        time.sleep(seconds)  # a measurement window, not a wait for an event
        end = sample()
    elapsed = end[0] - start[0]
    return {
        "rounds_per_s": (end[1] - start[1]) / elapsed,
        "bytes_sent": end[2] - start[2],
        "bytes_relayed": end[3] - start[3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=50.0, help="Mbit/s each way")
    parser.add_argument("--rtt", type=float, default=50.0, help="ms of round trip")
    args = parser.parse_args()
    reason = unavailable(NAT)
    if reason is not None:
        raise SystemExit(f"bench/nat.py needs the NAT lab: {reason}")
    link = Link(args.rate, args.rtt)
    ratios = []
    for n in range(args.runs):
        plain = measure(PLAIN, link, args.seconds)
        nat = measure(NAT, link, args.seconds)
        ratio = nat["rounds_per_s"] / plain["rounds_per_s"] if plain["rounds_per_s"] else 0.0
        share = nat["bytes_relayed"] / nat["bytes_sent"] if nat["bytes_sent"] else 0.0
        ratios.append(ratio)
        print(
            f"run {n + 1}: plain {plain['rounds_per_s']:.3f} rounds/s, "
            f"NAT {nat['rounds_per_s']:.3f} rounds/s, ratio {ratio:.2f}; "
            f"relay carried {share:.1%} of the bytes sent",
            flush=True,
        )
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
    print(
        f"NAT / plain routers, averaging rounds per second: median {statistics.median(ratios):.2f} "
        f"over {len(ratios)} runs (spread {spread}; goal >= 0.8)"
    )


if __name__ == "__main__":
    main()
