"""The catch-up policy on its own (peer.optim.shared.catchup.CatchUp), with a fake swarm: which
state it adopts, from whom it asks, and what it does when none comes — per policy. No
sockets: the node, tracker and averager are stand-ins holding what the swarm would say."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from peer.averaging.sharing.download import state_key
from peer.optim.shared.catchup import CatchUp, CatchUpHost, CatchUpPolicy
from peer.optim.shared.progress import ProgressReport, compute_swarm_progress

PREFIX = "run_state"
COLLABORATIVE = CatchUpPolicy(timeout=0.3, retry=True, on_timeout="discount", discount_s=60)
DECENTRALIZED = CatchUpPolicy(timeout=None, retry=False, on_timeout="move_on", discount_s=60)


def _report(peer_id: str, epoch: int, *, client_mode: bool = False) -> ProgressReport:
    return ProgressReport(peer_id, epoch, 0, 0, 0.0, 1.0, client_mode)


class FakeTracker:
    key = "run.progress"
    peer_id = "me"
    target = 100

    def __init__(self, reports: list[ProgressReport]) -> None:
        self.reports = reports
        self._discounted: dict[str, int] = {}

    def fetch(self, *, fresh: bool = False) -> list[ProgressReport]:
        return list(self.reports)

    def progress(self, local: ProgressReport, reports: Any = None) -> Any:
        reports = self.fetch() if reports is None else reports
        return compute_swarm_progress(reports, local, self.target, self.discounted())

    def discount(self, peer_id: str, epoch: int, seconds: float) -> None:
        self._discounted[peer_id] = epoch

    def discounted(self) -> dict[str, int]:
        return dict(self._discounted)


class FakeNode:
    peer_id = "me"

    def __init__(self, offers: dict[str, float]) -> None:
        self.offers = offers  # donor -> the epoch (priority) of the state it declares

    def get(self, key: str, latest: bool = False) -> Any:
        if key != state_key(PREFIX):
            return None
        items = {p: SimpleNamespace(value=v) for p, v in self.offers.items()}
        return SimpleNamespace(value=items)


class FakeAverager:
    last_state_donor = "donor"

    def __init__(self, downloads: list[Any], declare_state_period: float = 100.0) -> None:
        self.config = SimpleNamespace(prefix=PREFIX, declare_state_period=declare_state_period)
        self.downloads = downloads  # what each attempt returns (then None)
        self.asked: list[float] = []  # the max_priority of each attempt
        self.calls: list[dict[str, Any]] = []  # each attempt's keyword arguments
        self.refused: set[str] = set()  # donors whose states were dropped

    def refused_state_donors(self) -> frozenset[str]:
        return frozenset(self.refused)

    def load_state_from_peers(self, timeout: Any = None, **kwargs: Any) -> Any:
        self.asked.append(kwargs["max_priority"])
        self.calls.append(kwargs)
        result = self.downloads.pop(0) if self.downloads else None
        if result is not None and kwargs["check"](result[0]) is not None:
            return None  # refused, as the averager drops it
        return result


class Host:
    def __init__(self, epoch: int = 0, *, fits: bool = True, holds: bool = False) -> None:
        self.epoch = epoch
        self.fits = fits
        self.holds = holds
        self.settled = 0
        self.adopted: list[int] = []
        self.moved: list[int] = []

    def hooks(self) -> CatchUpHost:
        return CatchUpHost(
            local_epoch=lambda: self.epoch,
            settle=self._settle,
            report=lambda: _report("me", self.epoch),
            adopt=self._adopt,
            move_to=self._move_to,
            holds_state=lambda: self.holds,
        )

    def _settle(self) -> None:
        self.settled += 1

    def _adopt(self, epoch: int, metadata: Any, tensors: Sequence[torch.Tensor]) -> None:
        if not self.fits:
            raise ValueError("the downloaded state does not match this model")
        self.adopted.append(epoch)
        self.epoch = epoch

    def _move_to(self, epoch: int) -> None:
        self.moved.append(epoch)
        self.epoch = epoch


def _catch_up(
    host: Host,
    reports: list[ProgressReport],
    downloads: list[Any],
    policy: CatchUpPolicy,
    offers: dict[str, float] | None = None,
    declare_state_period: float = 100.0,
) -> tuple[CatchUp, FakeTracker, FakeAverager]:
    tracker = FakeTracker(reports)
    averager = FakeAverager(downloads, declare_state_period)
    catch_up = CatchUp(
        host.hooks(),
        node=FakeNode(offers or {}),  # type: ignore[arg-type]
        tracker=tracker,  # type: ignore[arg-type]
        averager=averager,  # type: ignore[arg-type]
        policy=policy,
        closing=threading.Event(),
    )
    return catch_up, tracker, averager


def _state(epoch: int) -> tuple[dict[str, int], list[torch.Tensor]]:
    return {"epoch": epoch}, [torch.zeros(2)]


@pytest.mark.parametrize("policy", [COLLABORATIVE, DECENTRALIZED])
def test_the_newest_state_within_the_swarms_epoch_is_adopted(policy: CatchUpPolicy) -> None:
    host = Host(0)
    catch_up, _, averager = _catch_up(host, [_report("a", 5)], [_state(5)], policy)
    assert catch_up.run() is True
    assert host.settled == 1, "background work settled before the download"
    assert host.adopted == [5] and host.moved == []
    assert averager.asked == [6], "no donor past the swarm's epoch plus one is asked"


def test_a_state_past_the_swarms_epoch_plus_one_or_older_than_this_peers_is_not_adopted() -> None:
    host = Host(3)
    catch_up, _, _ = _catch_up(host, [_report("a", 5)], [_state(9), _state(2)], DECENTRALIZED)
    assert catch_up.run(chase=False) is False  # epoch 9: refused by the check
    assert catch_up.run(chase=False) is False  # epoch 2: older than this peer's 3
    assert host.adopted == [] and host.epoch == 3


def test_a_peer_holding_a_state_asks_for_a_newer_one_only() -> None:
    """A peer that holds a state asks donors past its own epoch only, as a holder (another
    volunteer must confirm), and does not adopt a state at its own epoch: it would reset its
    progress for nothing."""
    host = Host(3, holds=True)
    catch_up, _, averager = _catch_up(host, [_report("a", 5)], [_state(3)], DECENTRALIZED)
    assert catch_up.run(chase=False) is False
    assert averager.calls[0]["holding"] is True and averager.calls[0]["min_priority"] == 4
    assert host.adopted == [] and host.epoch == 3
    newcomer = Host(0)
    catch_up, _, averager = _catch_up(newcomer, [_report("a", 5)], [_state(0)], DECENTRALIZED)
    catch_up.run(chase=False)
    assert averager.calls[0]["holding"] is False and newcomer.adopted == [0]


def test_a_refused_donors_claims_are_discounted_at_once() -> None:
    """A donor whose state this peer dropped backs its claim with nothing this peer can
    use: its claim ahead is discounted after the one attempt, with no retries and no
    waiting for the window to pass."""
    host = Host(2, holds=True)
    catch_up, tracker, averager = _catch_up(
        host, [_report("liar", 3)], [], COLLABORATIVE, offers={"liar": 3}
    )
    averager.refused.add("liar")
    assert catch_up.run() is False
    assert len(averager.asked) == 1, "retried a refused donor's claim"
    assert tracker.discounted() == {"liar": 3} and host.epoch == 2


def test_a_state_that_does_not_fit_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    host = Host(0, fits=False)
    catch_up, _, _ = _catch_up(host, [_report("a", 5)], [_state(5)], DECENTRALIZED)
    with caplog.at_level("WARNING", logger="peer.optim.catchup"):
        assert catch_up.run(chase=False) is False
    assert "does not fit" in caplog.text and host.epoch == 0


@pytest.mark.parametrize("policy", [COLLABORATIVE, DECENTRALIZED])
def test_a_swarm_led_by_client_mode_peers_is_caught_up_with_at_once(
    policy: CatchUpPolicy,
) -> None:
    host = Host(0)
    reports = [_report("hidden", 5, client_mode=True)]
    catch_up, _, averager = _catch_up(host, reports, [], policy)
    assert catch_up.run() is False
    assert host.moved == [5] and len(averager.asked) == 1, "one attempt, no retries"


def test_collaborative_no_state_in_time_discounts_the_claims_and_stays() -> None:
    host = Host(0)
    catch_up, tracker, averager = _catch_up(
        host, [_report("a", 5)], [], COLLABORATIVE, offers={"a": 5}
    )
    assert catch_up.run() is False
    assert len(averager.asked) > 1, "retried within the window"
    assert host.moved == [] and host.epoch == 0
    assert tracker.discounted() == {"a": 1}


def test_decentralized_moves_on_with_its_own_state_when_a_newer_one_was_offered() -> None:
    host = Host(0)
    catch_up, tracker, averager = _catch_up(
        host, [_report("a", 5)], [], DECENTRALIZED, offers={"a": 5}
    )
    assert catch_up.run() is False
    assert len(averager.asked) == 1
    assert host.moved == [5] and tracker.discounted() == {}


def test_decentralized_waits_a_declaration_period_then_discounts_claims_nobody_backs() -> None:
    host = Host(0)
    # nobody offers a newer state; within the declaration period it neither moves nor
    # discounts ...
    catch_up, tracker, _ = _catch_up(host, [_report("liar", 10**9)], [], DECENTRALIZED)
    assert catch_up.run() is False
    assert host.moved == [] and tracker.discounted() == {}
    # ... and once a period has passed with no offer (none here), the claim is discounted
    catch_up, tracker, _ = _catch_up(
        host, [_report("liar", 10**9)], [], DECENTRALIZED, declare_state_period=0.0
    )
    assert catch_up.run() is False
    assert host.moved == [] and tracker.discounted() == {"liar": 1}


def test_without_chase_one_attempt_and_nothing_else() -> None:
    host = Host(0)
    catch_up, tracker, averager = _catch_up(
        host, [_report("a", 5)], [], DECENTRALIZED, offers={"a": 5}
    )
    assert catch_up.run(chase=False) is False
    assert len(averager.asked) == 1 and host.moved == [] and tracker.discounted() == {}


def test_a_retry_ends_when_the_optimizer_shuts_down() -> None:
    host = Host(0)
    policy = CatchUpPolicy(timeout=600, retry=True, on_timeout="discount", discount_s=60)
    catch_up, _, averager = _catch_up(host, [_report("a", 5)], [], policy, offers={"a": 5})
    catch_up.closing.set()
    assert catch_up.run() is False
    assert len(averager.asked) == 1


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="on_timeout"):
        CatchUpPolicy(timeout=1, retry=True, on_timeout="wait", discount_s=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        CatchUpPolicy(timeout=-1, retry=True, on_timeout="discount", discount_s=1)
