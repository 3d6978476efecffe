"""The blockwise 8-bit and 4-bit codecs, and codecs by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from peer.compression import (
    BFloat16Compression,
    Blockwise4BitQuantization,
    Blockwise8BitQuantization,
    CompressedTensor,
    CompressionError,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    compression_from_name,
    extract,
)

CODECS = [Blockwise8BitQuantization(), Blockwise4BitQuantization()]


def _roundtrip(codec, tensor: torch.Tensor) -> torch.Tensor:
    header, payload = codec.compress(tensor).to_wire()
    return extract(CompressedTensor.from_wire(header, bytes(payload)))


@pytest.mark.parametrize("codec", CODECS)
@given(numel=st.integers(0, 700), scale=st.floats(1e-6, 1e3), seed=st.integers(0, 2**16))
def test_roundtrip_error_is_at_most_half_a_step_of_its_block(
    codec, numel: int, scale: float, seed: int
) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    header, payload = codec.compress(x).to_wire()
    assert len(bytes(payload)) == codec.payload_nbytes(numel, torch.float32)
    y = extract(CompressedTensor.from_wire(header, bytes(payload)))
    assert y.shape == x.shape and y.dtype == x.dtype
    for start in range(0, numel, codec.block):
        block = x[start : start + codec.block]
        step = float(block.abs().max()) / codec.levels
        err = (y[start : start + codec.block] - block).abs().max()
        assert float(err) <= step / 2 * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("codec", CODECS)
def test_an_outlier_only_coarsens_its_own_block(codec) -> None:
    x = torch.full((4 * codec.block,), 0.01)
    x[0] = 1000.0
    y = _roundtrip(codec, x)
    torch.testing.assert_close(y[codec.block :], x[codec.block :], atol=1e-3 * 0.01, rtol=0)


@pytest.mark.parametrize("codec", CODECS)
def test_shapes_dtypes_and_zeros_survive(codec) -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(3, 5, 7).to(dtype)
        y = _roundtrip(codec, x)
        assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(_roundtrip(codec, torch.zeros(300)), torch.zeros(300))
    ints = torch.arange(10)
    assert torch.equal(_roundtrip(codec, ints), ints)  # sent as "none"


def test_sizes_and_ratios() -> None:
    info = CompressionInfo.from_tensor(torch.zeros(1 << 16))
    assert Blockwise8BitQuantization().payload_nbytes(1000, torch.float32) == 1000 + 4 * 4
    assert Blockwise4BitQuantization().payload_nbytes(1001, torch.float32) == 501 + 4 * 8
    assert Blockwise8BitQuantization().estimate_compression_ratio(info) == pytest.approx(
        (1 + 4 / 256) / 4
    )
    assert Blockwise4BitQuantization().estimate_compression_ratio(info) == pytest.approx(
        (0.5 + 4 / 128) / 4
    )


@pytest.mark.parametrize("codec", CODECS)
def test_malformed_payloads_are_refused(codec) -> None:
    header, payload = codec.compress(torch.randn(300)).to_wire()
    data = bytearray(payload)
    with pytest.raises(CompressionError, match="payload"):
        CompressedTensor.from_wire(header, bytes(data[:-1]))
    bad_scale = bytearray(data)
    bad_scale[-4:] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(CompressionError, match="scales"):
        extract(CompressedTensor.from_wire(header, bytes(bad_scale)))
    negative = bytearray(data)
    negative[-4:] = torch.tensor([-1.0]).numpy().tobytes()
    with pytest.raises(CompressionError, match="scales"):
        extract(CompressedTensor.from_wire(header, bytes(negative)))
    if isinstance(codec, Blockwise8BitQuantization):
        wrong_code = bytearray(data)
        wrong_code[0] = 0x80  # -128: outside -127..127
        with pytest.raises(CompressionError, match="codes"):
            extract(CompressedTensor.from_wire(header, bytes(wrong_code)))
    with pytest.raises(CompressionError, match="meta"):
        CompressedTensor.from_wire({**header, "meta": {"x": 1.0}}, bytes(data))


def test_codecs_by_name() -> None:
    assert compression_from_name("none") == NoCompression()
    assert compression_from_name("fp16") == Float16Compression()
    assert compression_from_name("BF16") == BFloat16Compression()
    assert compression_from_name("int8") == Blockwise8BitQuantization()
    assert compression_from_name("int4") == Blockwise4BitQuantization()
    assert compression_from_name("uniform_8bit").name == "uniform_8bit"
    with pytest.raises(ValueError, match="unknown compression 'int3'; choose one of"):
        compression_from_name("int3")
    with pytest.raises(ValueError, match="string"):
        compression_from_name(8)  # type: ignore[arg-type]
