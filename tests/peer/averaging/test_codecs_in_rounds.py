"""Codec error bounds in rounds, and exact partition/reassembly for odd sizes."""

from __future__ import annotations

import pytest
import torch

from peer.averaging.allreduce.load_balancing import load_balance
from peer.averaging.allreduce.partition import FlatLayout, Partition
from peer.compression import (
    BFloat16Compression,
    CompressedTensor,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
    extract,
)


@pytest.mark.parametrize(
    ("codec", "bound"),
    [
        (Float16Compression(), 1e-5),
        (ScaledFloat16Compression(), 1e-5),
        (Uniform8BitQuantization(), 1e-2),
        (Quantile8BitQuantization(), 1e-2),
    ],
)
def test_codec_mse_on_unit_normal(codec, bound: float) -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    header, payload = codec.compress(x).to_wire()
    y = extract(CompressedTensor.from_wire(header, bytes(payload)))
    assert float(((x - y) ** 2).mean()) <= bound


@pytest.mark.parametrize("sizes", [[1], [7, 0, 1, 13], [0, 0, 5], [3, 1001, 2]])
@pytest.mark.parametrize("part_size_bytes", [1, 4, 12, 100, 4096])
@pytest.mark.parametrize("members", [1, 2, 3, 5])
def test_partition_and_reassembly_are_exact(sizes, part_size_bytes, members) -> None:
    tensors = [torch.randn(n) for n in sizes]
    layout = FlatLayout.from_tensors(tensors)
    flat = layout.flatten(tensors)
    spans = load_balance(layout.total, [1.0 + i for i in range(members)])
    partition = Partition(layout, spans, part_size_bytes, NoCompression())
    rebuilt = torch.full_like(flat, float("nan"))
    for part in partition.all_parts():
        header, payload = part.codec.compress(part.view(flat)).to_wire()
        values = extract(CompressedTensor.from_wire(header, bytearray(payload)))
        assert memoryview(payload).nbytes <= max(part_size_bytes, 4)
        part.view(rebuilt).copy_(values)
    assert torch.equal(rebuilt, flat)
    out = [torch.zeros(n) for n in sizes]
    layout.unflatten_into(rebuilt, out)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))


def test_bf16_and_fp16_rounds_keep_the_mean_close(make_swarm) -> None:
    """An all-reduce round with fp16 compression stays within the codec's error."""
    swarm = make_swarm(3)
    tensors = [[torch.randn(4000)] for _ in range(3)]
    mean = sum(t[0] for t in tensors) / 3
    from tests.peer.averaging.conftest import step_all

    averagers = swarm.add_averagers(tensors, compression=Float16Compression(), part_size_bytes=999)
    assert all(isinstance(r, dict) for r in step_all(averagers))
    for t in tensors:
        assert float(((t[0] - mean) ** 2).mean()) <= 1e-5
    assert BFloat16Compression().payload_itemsize(torch.float32) == 2
