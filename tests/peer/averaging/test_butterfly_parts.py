"""The butterfly round's pure parts on their own: the plan every member computes
(:mod:`peer.averaging.allreduce.plan`), decoding received frames
(:mod:`peer.averaging.allreduce.decode`) and writing results
(:mod:`peer.averaging.allreduce.results`). The machine over them is tested in
``test_butterfly.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import peer.averaging.allreduce.round as butterfly
from peer.averaging.allreduce.decode import average_values, batch_sizes, contribution_values
from peer.averaging.allreduce.partition import FlatLayout
from peer.averaging.allreduce.plan import RoundPlan, make_reducer, plan_round
from peer.averaging.allreduce.results import RoundResults, check_plausible
from peer.averaging.allreduce.vocabulary import AllreduceConfig, MemberInfo
from peer.averaging.protocol import AVERAGE, PART
from peer.compression import NoCompression
from peer.wire import Frame

LAYOUT = FlatLayout.from_tensors([torch.zeros(96)])
CONFIG = AllreduceConfig(part_size_bytes=64, relative_weight_bound=4.0)


def _members(weights: dict[str, float]) -> list[MemberInfo]:
    return [MemberInfo(p, False, 1.0, False, weight=w) for p, w in weights.items()]


def _plan(me: str, weights: dict[str, float]) -> RoundPlan:
    return plan_round(
        me, _members(weights), LAYOUT, compression=NoCompression(), roles=None, config=CONFIG
    )


def test_every_name_stays_importable_from_butterfly() -> None:
    for name in butterfly.__all__:
        assert getattr(butterfly, name) is not None
    assert butterfly.AllreduceConfig is AllreduceConfig
    assert butterfly.MemberInfo is MemberInfo


def test_every_member_plans_alike_and_an_overweight_one_reduces_nothing() -> None:
    weights = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 100.0}  # median 1: bound 4
    plans = [_plan(p, weights) for p in "abc"]
    assert all(plan.partition.spans == plans[0].partition.spans for plan in plans)
    plan = plans[0]
    assert plan.weight_bound == 4.0
    assert plan.overweight == {"d": 100.0}
    start, stop = plan.partition.spans[3]
    assert start == stop  # no span for the overweight member
    assert sum(sum(sizes) for sizes in plan.sizes) == LAYOUT.total
    assert all(all(flags) for flags in plan.plain)


def test_a_member_over_the_bound_cannot_start_its_own_round() -> None:
    with pytest.raises(ValueError, match="over the group's bound"):
        _plan("d", {"a": 1.0, "b": 1.0, "c": 1.0, "d": 100.0})


def test_declared_weights_count_only_when_every_sender_declared_one() -> None:
    members = [*_members({"a": 1.0, "b": 100.0}), MemberInfo("c", False, 1.0, False)]
    plan = plan_round("a", members, LAYOUT, compression=NoCompression(), roles=None, config=CONFIG)
    assert plan.declared == {}
    assert plan.overweight == {}


def test_a_reducer_only_where_there_is_a_span_and_a_sender() -> None:
    plan = _plan("a", {"a": 1.0, "b": 1.0})
    flat = torch.zeros(LAYOUT.total)
    reducer = make_reducer(
        plan, 0, LAYOUT, flat, config=CONFIG, scratch=None, in_place=True, alpha=1.0
    )
    assert reducer is not None and reducer.destination is not None  # straight into flat
    start, stop = plan.partition.spans[0]
    assert reducer.destination.data_ptr() == flat[start:stop].data_ptr()
    lerped = make_reducer(
        plan, 0, LAYOUT, flat, config=CONFIG, scratch=None, in_place=True, alpha=0.5
    )
    assert lerped is not None and lerped.destination is None
    auxiliary = [MemberInfo("a", False, 1.0, True), MemberInfo("b", False, 1.0, True)]
    none_send = plan_round(
        "a", auxiliary, LAYOUT, compression=NoCompression(), roles=None, config=CONFIG
    )
    assert (
        make_reducer(
            none_send, 0, LAYOUT, flat, config=CONFIG, scratch=None, in_place=True, alpha=1.0
        )
        is None
    )


@pytest.mark.parametrize(
    ("index", "count"), [(-1, 1), (0, 0), (2, 2), ("0", 1), (0, 1.0), (True, 1)]
)
def test_a_frame_claiming_parts_outside_the_span_is_refused(index: object, count: object) -> None:
    with pytest.raises(ValueError):
        batch_sizes([16, 16, 16], index, count)


def _plain(values: torch.Tensor) -> tuple[dict[str, object], bytes]:
    header = {"codec": "none", "dtype": "float32", "shape": [values.numel()], "meta": {}}
    return header, values.numpy().tobytes()


def test_contributions_decode_and_a_short_batch_is_refused() -> None:
    header, payload = _plain(torch.arange(32, dtype=torch.float32))
    frame = Frame(PART, {"c": header, "i": 0, "k": 2, "w": 1.0}, payload)
    values = contribution_values(frame, batch_sizes([16, 16, 16], 0, 2), 2, torch.float32)
    assert torch.equal(values, torch.arange(32, dtype=torch.float32))
    with pytest.raises(ValueError, match="batch of 32 values, expected 48"):
        contribution_values(frame, batch_sizes([16, 16, 16], 0, 3), 3, torch.float32)


def test_averages_must_be_finite_and_of_the_claimed_size() -> None:
    assert average_values(Frame(AVERAGE, {"i": 0}), [16], 1, torch.float32) is None
    with pytest.raises(ValueError, match="without averages"):
        average_values(Frame(AVERAGE, {"i": 0, "k": 2}), [16, 16], 2, torch.float32)
    nan = torch.full((16,), float("nan"))
    header, payload = _plain(nan)
    with pytest.raises(Exception, match="NaN or Inf"):
        average_values(Frame(AVERAGE, {"i": 0, "c": header}, payload), [16], 1, torch.float32)
    header, payload = _plain(torch.ones(8))
    with pytest.raises(ValueError, match="average of 8"):
        average_values(Frame(AVERAGE, {"i": 0, "c": header}, payload), [16], 1, torch.float32)


def test_delta_mode_writes_average_minus_local_and_zero_for_kept_values() -> None:
    results = RoundResults(in_place=False, alpha=1.0, trusted=set())
    slot = torch.full((4,), 3.0)
    results.write(slot, torch.full((4,), 5.0))
    assert torch.equal(slot, torch.full((4,), 2.0))
    results.keep_local(slot)
    assert torch.equal(slot, torch.zeros(4))


def test_in_place_averages_from_an_untrusted_reducer_wait_for_it() -> None:
    flat = torch.zeros(8)
    results = RoundResults(in_place=True, alpha=0.5, trusted={0})
    results.place(0, flat[:4], torch.full((4,), 2.0))  # trusted: written at once (lerp)
    results.place(1, flat[4:], torch.full((4,), 4.0))  # held
    assert flat.tolist() == [1.0] * 4 + [0.0] * 4
    results.trust(1)
    assert flat.tolist() == [1.0] * 4 + [2.0] * 4
    results.place(1, flat[4:], torch.full((4,), 2.0))  # trusted now: at once
    assert flat.tolist() == [1.0] * 4 + [2.0] * 4


def test_a_distrusted_reducer_leaves_its_span_at_the_local_values() -> None:
    flat = torch.ones(4)
    held = RoundResults(in_place=True, alpha=1.0, trusted=set())
    held.place(1, flat, torch.full((4,), 9.0))
    held.distrust(1, flat)
    held.finish()
    assert torch.equal(flat, torch.ones(4))
    delta = torch.full((4,), 7.0)
    RoundResults(in_place=False, alpha=1.0, trusted=set()).distrust(1, delta)
    assert torch.equal(delta, torch.zeros(4))  # delta 0: the local values


def test_finish_writes_what_is_still_held() -> None:
    flat = torch.ones(4)
    results = RoundResults(in_place=True, alpha=1.0, trusted=set())
    results.place(2, flat, torch.full((4,), 3.0))
    results.finish()
    assert torch.equal(flat, torch.full((4,), 3.0))


def test_an_average_far_beyond_this_peers_values_is_forged() -> None:
    flat = torch.from_numpy(np.full(8, 2.0, dtype=np.float32))
    check_plausible(torch.full((4,), 1e6), flat, 4, "trimmed_mean")  # at the factor: fine
    with pytest.raises(ValueError, match="no trimmed_mean of the group"):
        check_plausible(torch.full((4,), 1e7), flat, 4, "trimmed_mean")
