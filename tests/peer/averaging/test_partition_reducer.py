"""Partition/reassembly exactness, the weighted reducer, and a butterfly round without I/O."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.averaging.allreduce.partition import (
    FlatLayout,
    Partition,
    schema_hash,
    zeros_back_to_back,
)
from peer.averaging.allreduce.reducer import WeightedMeanReducer, apply_averaging_alpha
from peer.averaging.exceptions import BadContribution, UnexpectedSender
from peer.compression import (
    CompressedTensor,
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    Uniform8BitQuantization,
    extract,
)

shapes = st.lists(
    st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
)


def make(shape_list: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shape_list]


def split(total: int, cuts: list[int], n: int) -> list[int]:
    points = sorted(min(c, total) for c in cuts[: n - 1])
    edges = [0, *points, total]
    return [b - a for a, b in itertools.pairwise(edges)]


@settings(max_examples=200, deadline=None)
@given(
    shapes,
    st.integers(1, 5),
    st.lists(st.integers(0, 400), min_size=4, max_size=4),
    st.integers(1, 64),
    st.booleans(),
)
def test_partition_tiles_exactly_and_reassembles(shape_list, n, cuts, part_bytes, mixed) -> None:
    tensors = make(shape_list)
    layout = FlatLayout.from_tensors(tensors)
    spans = split(layout.total, cuts, n)
    codec = PerTensorCompression(
        [
            Uniform8BitQuantization() if i % 2 and mixed else NoCompression()
            for i in range(len(tensors))
        ]
    )
    partition = Partition(layout, spans, part_bytes, codec)
    flat = layout.flatten(tensors)
    position = 0
    for reducer in range(len(spans)):
        lo, hi = partition.spans[reducer]
        assert hi - lo == spans[reducer] and lo == position
        for index, part in enumerate(partition.parts_of(reducer)):
            assert (
                part.start == position
                and part.numel > 0
                and part.index == index
                and part.reducer == reducer
            )
            assert part.numel * part.codec.payload_itemsize(layout.dtype) <= max(part_bytes, 4)
            assert part.view(flat).data_ptr() == flat[part.start :].data_ptr()  # a view, not a copy
            position = part.stop
        assert position == hi
    assert position == layout.total
    # "averaged" values come back part by part; reassembly puts each where it belongs
    result = torch.empty_like(flat)
    for part in partition.all_parts():
        ct = NoCompression().compress(part.view(flat) * 2)
        result[part.start : part.stop] = extract(ct)
    out = [t.clone() for t in tensors]
    layout.unflatten_into(result, out)
    for a, b in zip(out, tensors, strict=True):
        assert a.shape == b.shape and torch.equal(a, b * 2)


def test_flatten_views_and_mixed_dtypes() -> None:
    tensors = [
        torch.tensor(1.0),
        torch.zeros(0, 3),
        torch.ones(2, 2).half(),
        torch.arange(3.0).double(),
    ]
    layout = FlatLayout.from_tensors(tensors)
    assert layout.total == 1 + 0 + 4 + 3 and layout.dtype == torch.float64
    flat = layout.flatten(tensors)
    assert [v.shape for v in layout.views(flat)] == [t.shape for t in tensors]
    out = [torch.zeros_like(t) for t in tensors]
    layout.unflatten_into(flat, out)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))
    with pytest.raises(ValueError):
        FlatLayout.from_tensors([torch.arange(3)])
    with pytest.raises(ValueError):
        layout.flatten(tensors[:2])
    with pytest.raises(ValueError):
        Partition(layout, [1, 2], 16)


def test_parts_do_not_cross_codec_changes() -> None:
    tensors = [torch.randn(5), torch.randn(5), torch.randn(5)]
    layout = FlatLayout.from_tensors(tensors)
    codec = PerTensorCompression([NoCompression(), NoCompression(), Float16Compression()])
    partition = Partition(layout, [15], 1 << 20, codec)
    assert [(p.start, p.stop, p.codec.name) for p in partition.parts_of(0)] == [
        (0, 10, "none"),
        (10, 15, "float16"),
    ]
    # part size counts compressed bytes: 8 bytes = 2 fp32 or 4 fp16 elements
    assert [p.numel for p in Partition(layout, [15], 8, codec).parts_of(0)] == [2, 2, 2, 2, 2, 4, 1]


def test_schema_hash_separates_shapes_dtypes_and_codecs() -> None:
    a = [torch.zeros(3), torch.zeros(2, 2)]
    assert schema_hash(a) == schema_hash([torch.ones(3), torch.ones(2, 2)])
    assert schema_hash(a) != schema_hash([torch.zeros(3), torch.zeros(4)])
    assert schema_hash(a) != schema_hash([torch.zeros(3).double(), torch.zeros(2, 2)])
    assert schema_hash(a) != schema_hash(a, Float16Compression())


# ------------------------------------------------------------------------ reducer


def test_weighted_mean_part_by_part() -> None:
    r = WeightedMeanReducer([3, 2], ["a", "b", "c"])
    xs = {p: torch.randn(5) for p in "abc"}
    ws = {"a": 1.0, "b": 2.0, "c": 0.5}
    done = []
    for p in "abc":
        done += r.accumulate(p, 1, xs[p][3:], ws[p])
    assert [d.index for d in done] == [1] and not r.is_final(0)
    for p in "abc":
        done += r.accumulate(p, 0, xs[p][:3], ws[p])
    assert r.is_finished
    expected = sum(ws[p] * xs[p] for p in "abc") / sum(ws.values())
    got = torch.cat([d.average for d in sorted(done, key=lambda d: d.index)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert done[0].senders == frozenset("abc")


def test_exclusion_drops_unfinished_contributions_exactly() -> None:
    r = WeightedMeanReducer([2, 2], ["a", "b", "c"])
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0]), torch.tensor([1e8, -1e8])
    r.accumulate("a", 0, a)
    r.accumulate("b", 0, b)
    (final0,) = r.accumulate("c", 0, c)  # part 0 final with c in it: stays
    r.accumulate("c", 1, c)
    r.accumulate("a", 1, a)
    assert r.exclude("c") == []  # part 1 still waits for b
    assert r.is_final(0) and r.waiting_for(1) == {"b"}
    assert r.accumulate("c", 1, c) == []  # late arrivals from an excluded sender are ignored
    (part1,) = r.accumulate("b", 1, b)
    assert torch.equal(part1.average, (a + b) / 2)  # exact: rebuilt, not subtracted
    assert part1.senders == {"a", "b"}
    torch.testing.assert_close(final0.average, (a + b + c) / 3)  # final parts keep c


def test_exclusion_can_finalise_waiting_parts() -> None:
    r = WeightedMeanReducer([1, 1], ["a", "b"])
    r.accumulate("a", 0, torch.tensor([4.0]))
    r.accumulate("a", 1, torch.tensor([6.0]))
    done = r.exclude("b")
    assert [d.index for d in done] == [0, 1] and float(done[1].average) == 6.0
    assert r.exclude("b") == []


def test_auxiliary_weight_zero_contributes_nothing() -> None:
    r = WeightedMeanReducer([2], ["a", "aux"])
    r.accumulate("aux", 0, None, weight=0.0)
    (done,) = r.accumulate("a", 0, torch.tensor([1.0, 2.0]), weight=3.0)
    assert torch.equal(done.average, torch.tensor([1.0, 2.0])) and done.senders == {"a"}
    r2 = WeightedMeanReducer([2], ["aux"])
    (nothing,) = r2.accumulate("aux", 0, None, weight=0.0)
    assert nothing.average is None  # members keep their local values


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("a", 0, torch.zeros(3)), "shape"),
        (("a", 0, torch.zeros(2).double()), "dtype"),
        (("a", 5, torch.zeros(2)), "no part"),
        (("a", 0, torch.zeros(2), -1.0), "weight"),
        (("a", 0, torch.zeros(2), math.nan), "weight"),
        (("a", 0, None), "missing"),
    ],
)
def test_bad_contributions_name_the_offender_and_change_nothing(args, match: str) -> None:
    r = WeightedMeanReducer([2], ["a", "b"])
    with pytest.raises(BadContribution, match=match) as info:
        r.accumulate(*args)
    assert info.value.sender == "a"
    assert not r.buffer.any() and r.waiting_for(0) == {"a", "b"}
    (done,) = r.exclude("a") + r.accumulate("b", 0, torch.ones(2))
    assert torch.equal(done.average, torch.ones(2))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_exclude_their_sender_when_the_part_completes(bad: float) -> None:
    """One check of each complete part's sum: a sender with NaN/Inf in it is excluded (and
    reported once), the part and the other open parts are rebuilt without it, and parts
    already final keep its finite values."""
    r = WeightedMeanReducer([2, 2, 2], ["a", "b", "c"])
    assert r.accumulate_range("a", 0, 3, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])) == []
    assert r.accumulate("c", 0, torch.tensor([3.0, 4.0])) == []
    (first,) = r.accumulate("b", 0, torch.tensor([5.0, 6.0]))  # b's finite part: kept
    assert torch.equal(first.average, torch.tensor([3.0, 4.0])) and r.take_rejected() == []
    assert r.accumulate_range("b", 1, 2, torch.tensor([1.0, bad, 7.0, 8.0]), 1.0) == []
    assert r.take_rejected() == []  # nothing is checked before the part is complete
    done = r.accumulate_range("c", 1, 2, torch.tensor([5.0, 6.0, 7.0, 8.0]))
    (offence,) = r.take_rejected()
    assert offence.sender == "b" and offence.part_index == 1 and "NaN or Inf" in str(offence)
    assert r.excluded == {"b"} and r.is_finished and r.take_rejected() == []
    assert [d.index for d in done] == [1, 2] and all(d.senders == {"a", "c"} for d in done)
    assert torch.equal(torch.cat([d.average for d in done]), torch.tensor([4.0, 5, 6, 7]))


def test_vouch_checks_a_complete_senders_values_in_open_parts() -> None:
    r = WeightedMeanReducer([2, 2], ["a", "b", "c"])
    r.accumulate_range("a", 0, 2, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert r.vouch("a") == [] and r.take_rejected() == []  # finite: nothing happens
    r.accumulate_range("b", 0, 2, torch.tensor([1.0, 2.0, 3.0, math.inf]))
    r.accumulate("c", 0, torch.tensor([4.0, 5.0]))  # part 0 completes, b's values in it fine
    assert r.take_rejected() == []
    assert r.vouch("b") == []  # b's part 1 is open: checked now, b excluded (c still owed)
    assert [o.part_index for o in r.take_rejected()] == [1] and r.excluded == {"b"}
    (last,) = r.accumulate("c", 1, torch.tensor([5.0, 6.0]))
    assert torch.equal(last.average, torch.tensor([4.0, 5.0])) and last.senders == {"a", "c"}


def test_non_finite_values_of_a_single_contributor_leave_no_average() -> None:
    r = WeightedMeanReducer([2], ["a", "aux"])
    assert r.accumulate("a", 0, torch.tensor([1.0, math.nan])) == []
    (done,) = r.accumulate("aux", 0, None, weight=0.0)
    assert done.average is None and [o.sender for o in r.take_rejected()] == ["a"]


def test_an_overflowing_sum_is_blamed_on_its_largest_contribution() -> None:
    """Finite values whose weighted sum overflows: the sender with the largest w·max|x| is
    excluded and named, the part rebuilt from the others; no average is ever infinite."""
    r = WeightedMeanReducer([2, 2], ["a", "b", "c"])
    r.accumulate("a", 0, torch.tensor([1.0, 2.0]))
    r.accumulate("b", 0, torch.tensor([3e38, 1.0]), weight=1.0)
    (done,) = r.accumulate("c", 0, torch.tensor([3e38, 5.0]), weight=1.0)
    (offence,) = r.take_rejected()
    assert offence.sender == "b" and "overflow" in str(offence), offence
    assert done.senders == {"a", "c"}
    torch.testing.assert_close(done.average, torch.tensor([1.5e38, 3.5]))
    # a weight that makes finite values overflow: blamed on the weight, not the values
    r.accumulate("a", 1, torch.tensor([1.0, 1.0]), weight=1.0)
    (done,) = r.accumulate("c", 1, torch.tensor([1e30, 0.0]), weight=1.0)
    assert torch.isfinite(done.average).all() and r.take_rejected() == []
    w = WeightedMeanReducer([1], ["a", "b"])
    w.accumulate("a", 0, torch.tensor([1e30]), weight=1.0)
    (done,) = w.accumulate("b", 0, torch.tensor([1e10]), weight=1e30)
    (offence,) = w.take_rejected()
    assert offence.sender == "b" and done.senders == {"a"}
    assert torch.equal(done.average, torch.tensor([1e30]))


def test_duplicates_unknown_senders_and_weight_changes() -> None:
    r = WeightedMeanReducer([1, 1], ["a", "b"])
    r.accumulate("a", 0, torch.zeros(1))
    with pytest.raises(BadContribution, match="duplicate"):
        r.accumulate("a", 0, torch.zeros(1))
    with pytest.raises(UnexpectedSender):
        r.accumulate("z", 0, torch.zeros(1))
    with pytest.raises(BadContribution, match="differs"):
        r.accumulate("a", 1, torch.zeros(1), weight=2.0)
    assert issubclass(BadContribution, ValueError)


def test_averaging_alpha() -> None:
    local, avg = torch.zeros(3), torch.full((3,), 2.0)
    apply_averaging_alpha(local, avg, 0.25)
    assert torch.equal(local, torch.full((3,), 0.5))
    apply_averaging_alpha(local, avg, 1.0)
    assert torch.equal(local, avg)
    with pytest.raises(ValueError):
        apply_averaging_alpha(local, avg, 1.5)


@pytest.mark.parametrize("part_bytes", [4, 36, 1 << 20])
def test_butterfly_round_without_io(part_bytes: int) -> None:
    """4 peers, odd tensors (zero-size and 0-d included), weights: everyone gets Σwx/Σw."""
    from peer.averaging.allreduce.load_balancing import load_balance

    shapes = [(3, 5), (0,), (), (7,)]
    peers = [make(shapes, seed=i) for i in range(4)]
    weights = [1.0, 2.0, 0.5, 3.0]
    layout = FlatLayout.from_tensors(peers[0])
    spans = load_balance(layout.total, [1.0, None, 2.0, 0.5])
    partition = Partition(layout, spans, part_bytes)
    flats = [layout.flatten(t) for t in peers]
    reducers = [WeightedMeanReducer(partition.part_sizes(r), range(4)) for r in range(4)]
    for sender, flat in enumerate(flats):
        for part in partition.all_parts():
            header, payload = NoCompression().compress(part.view(flat)).to_wire()
            values = extract(CompressedTensor.from_wire(header, bytes(payload)))
            for done in reducers[part.reducer].accumulate(
                sender, part.index, values, weights[sender]
            ):
                result = partition.part(part.reducer, done.index)
                for flat2 in flats:  # send the average back to every member
                    apply_averaging_alpha(result.view(flat2), done.average)
    expected = sum(w * f for w, f in zip(weights, flats, strict=True)) / sum(weights)
    for tensors, flat in zip(peers, flats, strict=True):
        torch.testing.assert_close(flat, expected, rtol=0, atol=1e-6)
        layout.unflatten_into(flat, tensors)
        assert tensors[1].shape == (0,) and tensors[2].shape == ()


def test_accumulate_range_equals_part_by_part() -> None:
    """A range of parts at once (as batched frames deliver them) gives bit-identical
    averages, whatever the order, even into a buffer full of garbage (no zeroing pass)."""
    sizes = [3, 2, 4, 1]
    g = torch.Generator().manual_seed(3)
    xs = {p: torch.randn(10, generator=g) for p in "abc"}
    ws = {"a": 1.0, "b": 2.5, "c": 0.75}
    one = WeightedMeanReducer(sizes, "abc")
    offsets = [0, 3, 5, 9, 10]
    for p in "abc":
        for i in range(4):
            one.accumulate(p, i, xs[p][offsets[i] : offsets[i + 1]], ws[p])
    many = WeightedMeanReducer(sizes, "abc", out=torch.full((10,), math.nan))
    # per part the same order (a, b, c) as above, in ranges cut differently per sender
    done = many.accumulate_range("a", 0, 4, xs["a"], ws["a"])
    done += many.accumulate_range("b", 1, 2, xs["b"][3:9], ws["b"])
    done += many.accumulate_range("b", 0, 1, xs["b"][:3], ws["b"])
    done += many.accumulate_range("b", 3, 1, xs["b"][9:], ws["b"])
    done += many.accumulate_range("c", 2, 2, xs["c"][5:], ws["c"])
    assert sorted(d.index for d in done) == [2, 3]
    done += many.accumulate_range("c", 0, 2, xs["c"][:5], ws["c"])
    assert sorted(d.index for d in done) == [0, 1, 2, 3] and many.is_finished
    assert torch.equal(many.buffer, one.buffer)
    expected = sum(ws[p] * xs[p] for p in "abc") / sum(ws.values())
    torch.testing.assert_close(many.buffer, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("index", "count", "values", "match"),
    [
        (2, 3, torch.zeros(4), "no parts"),  # past the end
        (-1, 2, torch.zeros(5), "no parts"),
        (0, 2, torch.zeros(4), "shape"),
        (0, 2, torch.zeros(5).double(), "dtype"),
        (2, 2, torch.zeros(4), "duplicate"),  # part 3 came already
    ],
)
def test_accumulate_range_rejects_and_changes_nothing(index, count, values, match) -> None:
    r = WeightedMeanReducer([3, 2, 3, 1], ["a", "b"])
    r.accumulate("a", 3, torch.ones(1))
    before = r.buffer.clone()
    with pytest.raises(BadContribution, match=match) as info:
        r.accumulate_range("a", index, count, values)
    assert info.value.sender == "a"
    assert torch.equal(r.buffer, before)
    assert [r.waiting_for(i) for i in range(4)] == [{"a", "b"}] * 3 + [{"b"}]


def test_destination_receives_the_averages() -> None:
    """With a destination (the in-place round's own span), averages are divided straight
    into it, and a part's retained contribution may live there until the part is final."""
    dest = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # this peer's own local values
    r = WeightedMeanReducer([3, 2], ["me", "b"], destination=dest)
    r.accumulate_range("me", 0, 2, dest, 1.0)
    (first,) = r.accumulate("b", 0, torch.tensor([3.0, 4.0, 5.0]))
    assert torch.equal(dest[:3], torch.tensor([2.0, 3.0, 4.0]))
    assert first.average is not None and first.average.data_ptr() == dest.data_ptr()
    r.exclude("b")  # part 1 is rebuilt from this peer's values, still intact in dest
    assert torch.equal(dest[3:], torch.tensor([4.0, 5.0])) and r.is_finished
    with pytest.raises(ValueError, match="destination"):
        WeightedMeanReducer([3, 2], ["a"], destination=torch.zeros(4))


def test_alias_is_the_tensors_own_memory() -> None:
    buffer = torch.arange(10.0)
    tensors = [buffer[:3], buffer[3:3], buffer[3:9].view(2, 3), buffer[9:].view(())]
    flat = FlatLayout.from_tensors(tensors).alias(tensors)
    assert flat is not None and flat.data_ptr() == buffer.data_ptr() and flat.shape == (10,)
    flat[4] = 100.0
    assert tensors[2][0, 1] == 100.0
    param = torch.nn.Parameter(torch.randn(4))
    alias = FlatLayout.from_tensors([param]).alias([param])
    assert alias is not None
    alias.mul_(0)  # no autograd complaint about a leaf that requires grad
    assert not param.detach().any()
    for others in (
        [buffer[1:4], buffer[0:1]],  # out of order
        [buffer[0:2], buffer[3:5]],  # a gap
        [torch.randn(2, 3).t()],  # not contiguous
        [torch.randn(2), torch.randn(2)],  # separate storages
        [buffer[0:2], buffer[2:4].double()],  # mixed dtypes
    ):
        assert FlatLayout.from_tensors(others).alias(others) is None


def test_zeros_back_to_back_alias_one_buffer() -> None:
    shapes = [torch.empty(3, 2), torch.empty(0), torch.empty(()), torch.empty(5)]
    zeros = zeros_back_to_back(shapes)
    assert [z.shape for z in zeros] == [s.shape for s in shapes]
    flat = FlatLayout.from_tensors(zeros).alias(zeros)
    assert flat is not None and flat.numel() == 12 and not flat.any()
    mixed = zeros_back_to_back([torch.empty(2), torch.empty(2, dtype=torch.float64)])
    assert [z.dtype for z in mixed] == [torch.float32, torch.float64]
    assert FlatLayout.from_tensors(mixed).alias(mixed) is None


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    weights=st.lists(st.sampled_from([0.0, 1.0, 0.5, 2.0, 3.25]), min_size=1, max_size=4),
    data=st.data(),
)
def test_any_arrival_order_cut_and_exclusion_gives_the_weighted_mean(sizes, weights, data) -> None:
    """Against a float64 reference: whatever batches the senders cut, in whatever order
    they arrive, with a sender excluded at any moment, every final part is the weighted mean
    of the contributions it names (a single contributor's values exactly), and parts with
    no positive weight have no average."""
    senders = [f"s{i}" for i in range(len(weights))]
    offsets = [0, *itertools.accumulate(sizes)]
    total = offsets[-1]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    xs = {s: torch.randn(total, generator=g) for s in senders}
    # one sender may have a NaN/Inf in one part: it must never reach an average
    poisoned = data.draw(st.sampled_from([None, *senders]))
    poisoned_part = data.draw(st.integers(0, len(sizes) - 1))
    if poisoned is not None and sizes[poisoned_part]:
        at = offsets[poisoned_part] + data.draw(st.integers(0, sizes[poisoned_part] - 1))
        xs[poisoned][at] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    else:
        poisoned = None
    reference = {s: x.clone() for s, x in xs.items()}
    # the own contribution may live in the destination, overwritten by averages as it goes
    destination = xs[senders[0]] if data.draw(st.booleans()) else None
    reducer = WeightedMeanReducer(
        sizes, senders, out=torch.full((total,), math.nan), destination=destination
    )
    batches = []  # each sender's parts cut into consecutive batches
    for s in senders:
        cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(sizes) - 1)))))
        bounds = sorted({0, *(c for c in cuts if c < len(sizes)), len(sizes)})
        batches += [(s, a, b) for a, b in itertools.pairwise(bounds)]
    order = data.draw(st.permutations(batches))
    exclude_at = data.draw(st.integers(0, len(order)))
    excluded = data.draw(st.sampled_from(senders))
    done = {}
    for step, (s, a, b) in enumerate([*order, (None, 0, 0)]):
        if step == exclude_at:
            done.update({d.index: d for d in reducer.exclude(excluded)})
        if s is None:
            break
        values = xs[s][offsets[a] : offsets[b]]
        weight = weights[senders.index(s)]
        done.update({d.index: d for d in reducer.accumulate_range(s, a, b - a, values, weight)})
    assert sorted(done) == list(range(len(sizes))) and reducer.is_finished
    rejected = [offence.sender for offence in reducer.take_rejected()]
    assert rejected in ([], [poisoned])
    if poisoned is not None and weights[senders.index(poisoned)] > 0:
        assert poisoned in reducer.excluded  # rejected, unless excluded before its part completed
    for index, part in done.items():
        if index == poisoned_part and poisoned is not None:
            assert poisoned not in part.senders or weights[senders.index(poisoned)] == 0
        if part.average is not None:
            assert torch.isfinite(part.average).all()
        lo, hi = offsets[index], offsets[index + 1]
        ws = {s: weights[senders.index(s)] for s in part.senders}
        assert all(w > 0 for w in ws.values())
        if not ws:
            assert part.average is None
            continue
        assert part.average is not None and part.total_weight == pytest.approx(sum(ws.values()))
        if len(ws) == 1:
            assert torch.equal(part.average, reference[next(iter(ws))][lo:hi])
            continue
        expected = sum(w * reference[s][lo:hi].double() for s, w in ws.items()) / sum(ws.values())
        torch.testing.assert_close(part.average.double(), expected, rtol=0, atol=1e-6)
