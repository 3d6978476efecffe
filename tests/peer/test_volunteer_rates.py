"""The rates on a volunteer's line are counted, as the dashboard counts them: its own samples
over its own clock, and the swarm's from the growth of the peers' progress records — never
the speeds the peers claim (compute alone, which says nothing of the time spent waiting)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import peer.trainer
from peer.formats.rates import CountedRate, rate_between
from peer.optim.shared.progress import ProgressReport, SwarmCounter
from peer.trainer import Trainer
from peer.volunteer import JoinOptions, Volunteer, VolunteerStatus
from swarmgrad.join import epoch_line

BATCH = 32
STEP_S = 0.096  # 32 samples every 96 ms: 333.3 samples/s on each of three peers
CLAIMED = 32032.9  # what each peer's records say it computes (three make 96098.8)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


class Loss:
    def backward(self) -> None:
        pass

    def detach(self) -> Loss:
        return self

    def __float__(self) -> float:
        return 0.5


class Swarm:
    """The optimizer of one of three peers that each train 333.3 samples/s (one step of 32
    samples every 96 ms, on the clock), and whose records claim 32,032.9 samples/s each."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.started = clock.now
        self.local_epoch = 0
        self.rounds_done = self.rounds_failed = 0
        self.last_failure = None
        self.last_group_size = 3
        self.node = SimpleNamespace(bytes_sent=0, visible_addresses=[], link_kinds=dict)
        self.performance = SimpleNamespace(samples_per_second=0.0)
        self.param_groups: list[dict[str, float]] = [{"lr": 0.1}]
        self.global_progress = SimpleNamespace(samples_per_second=3 * CLAIMED)
        self.tracker = SimpleNamespace(fetch=self.records)
        self.samples = 0

    def step(self, batch_size: int) -> None:
        self.clock.now += STEP_S
        self.samples += batch_size
        self.local_epoch = self.samples // 1000

    def zero_grad(self) -> None:
        pass

    def synchronised_state_dict(self, model: object) -> dict[str, object]:
        return {}  # (the model the volunteer evaluates: this test's has no tensors)

    def records(self) -> list[ProgressReport]:
        others = int((self.clock.now - self.started) / STEP_S) * BATCH
        done = {"me": self.samples, "a": others + 5000, "b": others + 9000}  # a, b came earlier
        return [
            ProgressReport(peer, self.local_epoch, 0, total, self.clock.now, CLAIMED)
            for peer, total in done.items()
        ]


def trained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float) -> VolunteerStatus:
    clock = Clock()
    monkeypatch.setattr(peer.trainer, "time", clock)
    volunteer = Volunteer(JoinOptions("http://c", "sgj_x", data_dir=tmp_path))
    optimizer = Swarm(clock)
    task = SimpleNamespace(
        loss=lambda model, batch: Loss(),
        batch_size=lambda batch: BATCH,
        evaluate=lambda model, config: 0.9,
    )
    session = SimpleNamespace(
        submit_report=lambda fields: None, coordinator_reachable=True, status="running"
    )
    answer = SimpleNamespace(peer_id="me", report_interval_s=10.0)
    config = SimpleNamespace(
        checkpoint_every=0,
        recompute_statistics=0,
        precision="fp32",
        max_grad_norm=None,
        lr_at=lambda epoch: 0.1,
    )
    model = SimpleNamespace(train=lambda: None, state_dict=dict, load_state_dict=lambda s: None)
    trainer = Trainer(volunteer, None, answer, session, task, config, model, optimizer)
    try:
        while clock.now - optimizer.started < seconds:
            trainer._step([object()])
    finally:
        trainer.close()
    return volunteer.status


def rates(line: str) -> tuple[str, str]:
    found = re.search(r"\| (\S+) samples/s \(swarm (\S+)\) \|", line)
    assert found, line
    return found.group(1), found.group(2)


def test_the_line_shows_the_counted_rates_not_the_claimed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    status = trained(tmp_path, monkeypatch, seconds=30.0)
    here, swarm = rates(epoch_line(status))
    assert float(here) == pytest.approx(BATCH / STEP_S, rel=0.01), epoch_line(status)
    assert float(swarm) == pytest.approx(3 * BATCH / STEP_S, rel=0.01), epoch_line(status)


def test_no_rate_before_a_second_of_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    status = trained(tmp_path, monkeypatch, seconds=0.5)
    assert status.samples > 0
    assert rates(epoch_line(status)) == ("-", "-")


def test_a_counted_rate_is_the_growth_over_the_newest_window() -> None:
    rate = CountedRate(window=10.0, min_span=1.0)
    assert rate.per_second is None
    rate.add(0.0, 0)
    rate.add(0.5, 100)
    assert rate.per_second is None, "less than a second: no rate yet"
    rate.add(2.0, 400)
    assert rate.per_second == pytest.approx(200.0)
    for t in range(3, 31):  # 100/s from t=2 on
        rate.add(float(t), 400 + 100 * (t - 2))
    assert rate.per_second == pytest.approx(100.0), "the early burst left the window"
    for t in range(31, 46):  # stopped: the rate falls to 0 within a window
        rate.add(float(t), 3200)
    assert rate.per_second == 0.0
    rate.add(40.0, 10**9)  # a reading from the past is ignored
    assert rate.per_second == 0.0
    assert len(rate._points) <= 12, "only the readings the window needs are kept"


def test_rate_between() -> None:
    assert rate_between((0.0, 10), (4.0, 30)) == 5.0
    assert rate_between((0.0, 30), (4.0, 10)) == 0.0
    assert rate_between((0.0, 10), (0.5, 30)) is None


def test_the_swarm_counter_counts_growth_since_first_seen_and_restarts() -> None:
    counter = SwarmCounter()

    def seen(**totals: int) -> int:
        return counter.observe(
            ProgressReport(peer, 0, 0, total, 0.0, CLAIMED) for peer, total in totals.items()
        )

    assert seen(a=5000, b=100) == 0, "what a peer did before it was seen is not a rate"
    assert seen(a=5100, b=150) == 150
    assert seen(a=40, b=200) == 240, "a peer that started again: its new count is growth"
    assert seen(b=260) == 300, "a peer that left adds nothing more"
    assert seen(a=90, b=300) == 340, "and seen again it starts from its count then"
