"""Load balancing: exact integer spans, zero for bandwidth 0, min_vector_size, optimality."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.averaging.allreduce.load_balancing import (
    load_balance,
    max_transfer_time,
    optimal_fractions,
    resolve_bandwidths,
)

bandwidth = st.one_of(st.none(), st.just(0.0), st.floats(0.1, 1000.0))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**7), st.lists(bandwidth, min_size=1, max_size=12), st.integers(0, 5000))
def test_invariants(n: int, bws: list[float | None], min_size: int) -> None:
    if not any(b is None or b > 0 for b in bws):
        with pytest.raises(ValueError):
            load_balance(n, bws, min_size)
        return
    spans = load_balance(n, bws, min_size)
    assert len(spans) == len(bws) and sum(spans) == n and all(s >= 0 for s in spans)
    assert all(s == 0 for s, b in zip(spans, bws, strict=True) if b == 0)
    reducers = [s for s in spans if s > 0]
    assert all(s >= min_size for s in reducers) or len(reducers) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.5, 100.0), min_size=3, max_size=8), st.integers(0, 2**32 - 1))
def test_water_filling_is_optimal(bws: list[float], seed: int) -> None:
    n_elements = 10**6
    best = max_transfer_time([round(f * n_elements) for f in optimal_fractions(bws)], bws)
    rng = random.Random(seed)
    for _ in range(30):  # no random split beats it (up to integer rounding)
        weights = [rng.random() for _ in bws]
        split = [int(w / sum(weights) * n_elements) for w in weights]
        split[0] += n_elements - sum(split)
        assert max_transfer_time(split, bws) >= best * (1 - 1e-6)
    spans = load_balance(n_elements, bws)
    # both the reference and load_balance round the optimal fractions to whole elements,
    # each moving a reducer's time by up to (n - 2) / bandwidth per element, in either sense
    slack = 2 * (len(bws) - 2) / min(bws) + 1e-6 * best
    assert max_transfer_time(spans, bws) <= best + slack


def test_equal_bandwidths_split_evenly_and_slow_peers_get_nothing() -> None:
    assert load_balance(10, [1, 1, 1]) == [4, 3, 3]
    assert load_balance(9, [None, None, None]) == [3, 3, 3]
    # with 4 members, a peer 20x slower than the others reduces nothing
    spans = load_balance(1000, [20.0, 20.0, 20.0, 1.0])
    assert spans[3] == 0 and sum(spans) == 1000
    # two members: any split costs the same; share by bandwidth
    assert load_balance(300, [1.0, 2.0]) == [100, 200]


def test_client_mode_and_min_vector_size() -> None:
    assert load_balance(100, [0, 5, 0, 5]) == [0, 50, 0, 50]
    assert load_balance(100, [1, 1, 1, 1], min_vector_size=30) in (
        [34, 33, 33, 0],
        [34, 33, 0, 33],
        [34, 0, 33, 33],
        [0, 34, 33, 33],
    )
    assert sorted(load_balance(10, [1, 2, 3], min_vector_size=100)) == [0, 0, 10]
    assert load_balance(0, [1, 1]) == [0, 0]
    with pytest.raises(ValueError):
        load_balance(10, [0, 0])
    with pytest.raises(ValueError):
        resolve_bandwidths([-1.0])
    assert resolve_bandwidths([None, 2.0, 4.0, 0.0]) == [3.0, 2.0, 4.0, 0.0]
