"""Moshpit group bits: key format, rotation, and the 8-peer grid simulated without a network."""

from __future__ import annotations

import hashlib
from collections import defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from peer.averaging.matchmaking.group_bits import (
    bits_per_coordinate,
    grid_bits,
    group_key,
    next_group_bits,
    parse_group_key,
    slot_in_group,
    validate_group_bits,
)


def test_key_format_and_parse() -> None:
    assert group_key("run1.params", "101", 2) == "run1.params.0b01"
    assert parse_group_key("run1.params.0b01") == ("run1.params", "01")
    assert group_key("p", "", 2) == "p.0b"
    with pytest.raises(ValueError):
        parse_group_key("no-bits-here")
    with pytest.raises(ValueError):
        validate_group_bits("012")
    with pytest.raises(ValueError):
        group_key("", "0", 2)


def test_bits_per_coordinate() -> None:
    assert [bits_per_coordinate(m) for m in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


@given(st.binary(min_size=1, max_size=16), st.integers(1, 16))
def test_slots_distinct_within_group(group_id: bytes, target: int) -> None:
    size = target
    slots = [slot_in_group(group_id, i, size, target) for i in range(size)]
    assert sorted(slots) == list(range(target))


def test_next_bits_rotates_and_keeps_length() -> None:
    assert next_group_bits("110", 0, 2) == "100"
    assert next_group_bits("110", 1, 2) == "101"
    assert next_group_bits("0110", 3, 4) == "1011"
    assert next_group_bits("", 1, 2) == ""
    with pytest.raises(ValueError):
        next_group_bits("00", 2, 2)


def test_grid_bits_pairs_consecutive_peers() -> None:
    bits = [grid_bits(i, 8, 2) for i in range(8)]
    assert all(len(b) == 3 for b in bits)
    keys = [group_key("p", b, 2) for b in bits]
    assert [keys[2 * k] == keys[2 * k + 1] for k in range(4)] == [True] * 4
    assert len(set(keys)) == 4
    with pytest.raises(ValueError):
        grid_bits(0, 6, 2)


def _simulate(
    num_peers: int, target: int, rounds: int, seed: int
) -> list[tuple[list[list[int]], torch.Tensor]]:
    """Group peers by key each round, average inside groups, update bits; no network."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(num_peers, 5, generator=generator, dtype=torch.float64)  # [peer, dim]
    bits = [grid_bits(i, num_peers, target) for i in range(num_peers)]
    history = []
    for round_index in range(rounds):
        by_key: dict[str, list[int]] = defaultdict(list)
        for peer, b in enumerate(bits):
            by_key[group_key("run", b, target)].append(peer)
        groups = sorted(by_key.values())
        for members in groups:
            values[members] = values[members].mean(dim=0)
            group_id = hashlib.sha256(f"{round_index}:{members}".encode()).digest()
            for index, peer in enumerate(members):
                slot = slot_in_group(group_id, index, len(members), target)
                bits[peer] = next_group_bits(bits[peer], slot, target)
        history.append((groups, values.clone()))
    return history


@pytest.mark.parametrize("seed", range(5))
def test_moshpit_grid_8_peers_pairs(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    initial = torch.randn(8, 5, generator=generator, dtype=torch.float64)
    global_mean = initial.mean(dim=0)
    history = _simulate(8, 2, rounds=6, seed=seed)
    assert history[0][0] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for round_index, (groups, values) in enumerate(history):
        assert all(len(g) == 2 for g in groups), (round_index, groups)
        torch.testing.assert_close(values.mean(dim=0), global_mean, rtol=0, atol=1e-12)
        # "from round 3 on": after rounds 0, 1, 2 every peer holds the global mean
        if round_index >= 2:
            torch.testing.assert_close(values, global_mean.expand(8, -1), rtol=0, atol=1e-6)
        else:
            assert not torch.allclose(values, global_mean.expand(8, -1), atol=1e-6)


def test_moshpit_grid_16_peers_groups_of_4() -> None:
    generator = torch.Generator().manual_seed(0)
    initial = torch.randn(16, 5, generator=generator, dtype=torch.float64)
    history = _simulate(16, 4, rounds=4, seed=0)
    for groups, _ in history:
        assert all(len(g) == 4 for g in groups)
    torch.testing.assert_close(history[1][1], initial.mean(dim=0).expand(16, -1), rtol=0, atol=1e-6)
