"""The volunteer's path, measured: what reporting to the coordinator costs a training peer, how
long a new volunteer takes to its first averaged step, and ``swarmgrad demo`` to its first
swarm epoch.

    python bench/join.py                 # all three
    python bench/join.py --rounds 10     # more alternations of the reporting comparison

Printed figures (ratios and times of this run; compare them across changes on one machine):

* reporting overhead: samples/s of one peer training digits while it reports to a
  coordinator every second, against the same peer while its reports go nowhere (the
  session's ``submit_report`` made a no-op). One peer alternates between the two every
  ``--window`` seconds, ``--rounds`` pairs, so the machine's drift cancels; the ratio of each
  pair is printed, then their median and spread;
* join → first averaged step: a second volunteer joins a run where one trains already;
  seconds from ``Volunteer.run()`` to its first finished averaging round;
* demo → first swarm epoch: ``swarmgrad demo --peers 2``, seconds from its start until it
  prints its first line for an epoch above 0.

``python bench/join.py --demo-against-mean 3`` instead runs ``swarmgrad demo`` (4 peers,
``--demo-epochs`` epochs) in pairs, once with a run's averaging defaults and once with
``aggregator=mean, relative_weight_bound=null``, in alternating order, and prints each run's
training rate (samples counted between its first and last epoch lines over the time between
them) and each pair's ratio defaults / mean, then their median and range.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.coordinator import CoordinatorClient, CoordinatorSession
from peer.volunteer import JoinOptions, Volunteer, VolunteerStatus
from swarmgrad.local import LocalCoordinator, child_environment, stop_process

# A run that never ends by itself, with rounds a lone peer skips at once.
RUN_CONFIG = {"epochs": None, "checkpoint_every": 0}


@contextlib.contextmanager
def volunteer(
    coordinator: LocalCoordinator, token: str, data_dir: Path
) -> Iterator[tuple[Volunteer, list[tuple[float, VolunteerStatus]]]]:
    """A volunteer training in a thread; its status updates with their times."""
    updates: list[tuple[float, VolunteerStatus]] = []
    peer = Volunteer(
        JoinOptions(url=coordinator.url, token=token, host="127.0.0.1", data_dir=data_dir),
        on_update=lambda status: updates.append((time.monotonic(), status)),
    )
    failure: list[BaseException] = []

    def run() -> None:
        try:
            peer.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield peer, updates
    finally:
        peer.stop()
        thread.join(60)
    if failure:
        raise failure[0]


def _wait_for(value: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while (found := value()) is None:
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.05)
    return found


def reporting_overhead(
    coordinator: LocalCoordinator, client: CoordinatorClient, root: Path, args: Any
) -> list[float]:
    """Ratios of samples/s with and without reporting, one per pair of alternating phases of
    one peer (so drift of the machine's speed cancels out)."""
    run = client.create_run(coordinator.admin_token, "overhead", "digits", RUN_CONFIG)
    token = client.create_invite(coordinator.admin_token, run.id).token
    reporting = threading.Event()
    real_submit = CoordinatorSession.submit_report

    def submit(self: CoordinatorSession, fields: Any) -> None:
        if reporting.is_set():
            real_submit(self, fields)

    CoordinatorSession.submit_report = submit  # type: ignore[method-assign]
    ratios = []
    try:
        with volunteer(coordinator, token, root / "overhead") as (_, updates):
            _wait_for(lambda: next((t for t, s in updates if s.samples > 0), None), 120)
            time.sleep(args.warmup)
            for i in range(args.rounds):
                speeds = {}
                for mode in (True, False):
                    if mode:
                        reporting.set()
                    else:
                        reporting.clear()
                    start = time.monotonic()
                    time.sleep(args.window)  # a measurement window, not a synchronisation
                    inside = [(t, s.samples) for t, s in updates if t >= start]
                    (t0, n0), (t1, n1) = inside[0], inside[-1]
                    speeds[mode] = (n1 - n0) / (t1 - t0)
                ratios.append(speeds[True] / speeds[False])
                print(
                    f"  pair {i + 1}: reporting {speeds[True]:,.0f} samples/s, "
                    f"silent {speeds[False]:,.0f} samples/s, ratio {ratios[-1]:.3f}",
                    flush=True,
                )
    finally:
        CoordinatorSession.submit_report = real_submit  # type: ignore[method-assign]
    return ratios


def join_to_first_round(
    coordinator: LocalCoordinator, client: CoordinatorClient, root: Path
) -> float:
    config = dict(RUN_CONFIG, target_batch_size=64)
    run = client.create_run(coordinator.admin_token, "first-round", "digits", config)
    token = client.create_invite(coordinator.admin_token, run.id).token
    with volunteer(coordinator, token, root / "first") as (_, first):
        _wait_for(lambda: next((t for t, s in first if s.samples > 0), None), 120)
        started = time.monotonic()
        with volunteer(coordinator, token, root / "second") as (_, second):
            averaged = _wait_for(
                lambda: next((t for t, s in second if s.group_size and s.group_size > 1), None),
                180,
            )
    return averaged - started


def demo_to_first_epoch() -> float:
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "swarmgrad", "demo", "--peers", "2", "--epochs", "2"],
        env=child_environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            match = re.search(r"\bepoch (\d+)\b", line)
            if match and int(match.group(1)) >= 1:
                return time.monotonic() - started
        raise SystemExit("the demo ended before its first swarm epoch")
    finally:
        stop_process(process)


PLAIN_MEAN = ["--config", "aggregator=mean", "--config", "relative_weight_bound=null"]


def demo_training_rate(epochs: int, extra: list[str]) -> float:
    """samples/s of a whole ``swarmgrad demo`` between its first and last epoch lines."""
    command = [sys.executable, "-m", "swarmgrad", "demo", "--epochs", str(epochs), *extra]
    process = subprocess.Popen(
        command,
        env=child_environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[tuple[float, int]] = []
    output: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            match = re.search(r"\bepoch (\d+) \| samples ([\d,]+)", line)
            if match and int(match.group(1)) >= 1:
                seen.append((time.monotonic(), int(match.group(2).replace(",", ""))))
        code = process.wait()
    finally:
        stop_process(process)
    if code != 0 or len(seen) < 2:
        raise SystemExit(f"swarmgrad demo failed (status {code}):\n{''.join(output[-10:])}")
    (t0, s0), (t1, s1) = seen[0], seen[-1]
    return (s1 - s0) / (t1 - t0)


def demo_against_mean(pairs: int, epochs: int) -> None:
    print(f"swarmgrad demo (4 peers, {epochs} epochs): samples/s with the defaults / the mean")
    ratios = []
    for pair in range(pairs):
        rates = {}
        order = ("defaults", "mean") if pair % 2 == 0 else ("mean", "defaults")
        for name in order:
            rates[name] = demo_training_rate(epochs, PLAIN_MEAN if name == "mean" else [])
        ratios.append(rates["defaults"] / rates["mean"])
        print(
            f"  pair {pair + 1}: defaults {rates['defaults']:.0f}, mean {rates['mean']:.0f} "
            f"samples/s, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print(
        f"  ratio defaults / mean: median {statistics.median(ratios):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10, help="reporting/silent pairs")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument(
        "--demo-against-mean",
        type=int,
        metavar="PAIRS",
        help="only pairs of swarmgrad demo runs, the defaults against the plain mean",
    )
    parser.add_argument("--demo-epochs", type=int, default=40)
    args = parser.parse_args(argv)
    if args.demo_against_mean:
        demo_against_mean(args.demo_against_mean, args.demo_epochs)
        return 0
    with (
        tempfile.TemporaryDirectory(prefix="swarmgrad-bench-") as temp,
        LocalCoordinator(Path(temp) / "coordinator") as coordinator,
        CoordinatorClient(coordinator.url) as client,
    ):
        root = Path(temp)
        seconds = join_to_first_round(coordinator, client, root)
        print(f"join -> first averaged step (a second volunteer): {seconds:.1f} s", flush=True)
        print(f"reporting overhead, one digits peer, {args.rounds} pairs of {args.window:.0f} s:")
        ratios = reporting_overhead(coordinator, client, root, args)
        print(
            f"  samples/s reporting / silent: median {statistics.median(ratios):.3f}, "
            f"range {min(ratios):.3f}-{max(ratios):.3f}"
        )
    print(f"swarmgrad demo -> first swarm epoch (2 peers): {demo_to_first_epoch():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
