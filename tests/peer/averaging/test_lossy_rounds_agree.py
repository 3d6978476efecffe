"""Through a lossy codec, every member of a round ends with the same values: a span's
reducer keeps what the others decode of its average, not the exact average."""

from __future__ import annotations

import pytest
import torch

from peer.compression import (
    Blockwise4BitQuantization,
    Blockwise8BitQuantization,
    Compression,
    Float16Compression,
    Uniform8BitQuantization,
)
from tests.peer.averaging.conftest import step_all


@pytest.mark.parametrize(
    "codec",
    [Blockwise8BitQuantization(), Blockwise4BitQuantization(), Uniform8BitQuantization()],
    ids=lambda c: c.name,
)
def test_members_of_a_lossy_round_end_with_the_same_values(make_swarm, codec: Compression) -> None:
    swarm = make_swarm(3)
    g = torch.Generator().manual_seed(0)
    tensors = [[torch.randn(3000, generator=g), torch.randn(7, 11, generator=g)] for _ in range(3)]
    mean = [sum(t[i] for t in tensors) / 3 for i in range(2)]
    # several parts per span, so that every member reduces some and decodes others
    averagers = swarm.add_averagers(tensors, compression=codec, part_size_bytes=1000)
    assert all(isinstance(r, dict) for r in step_all(averagers))
    for t in tensors[1:]:
        for mine, first in zip(t, tensors[0], strict=True):
            assert torch.equal(mine, first)
    for got, expected in zip(tensors[0], mean, strict=True):
        assert float((got - expected).abs().max()) <= 0.5 * float(expected.abs().max())


def test_a_round_with_fp16_agrees_to_the_bit_too(make_swarm) -> None:
    swarm = make_swarm(2)
    tensors = [[torch.randn(2000) * 1e-3] for _ in range(2)]
    averagers = swarm.add_averagers(tensors, compression=Float16Compression(), part_size_bytes=999)
    assert all(isinstance(r, dict) for r in step_all(averagers))
    assert torch.equal(tensors[0][0], tensors[1][0])
