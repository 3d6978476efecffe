"""Codecs: error bounds, wire round trips, strict validation of bad payloads, wrappers."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from peer.compression import (
    BFloat16Compression,
    CompressedTensor,
    CompressionError,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    Quantile8BitQuantization,
    RoleAdaptiveCompression,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    TensorRole,
    Uniform8BitQuantization,
    extract,
    plain_values,
)

ALL = [
    NoCompression(),
    Float16Compression(),
    ScaledFloat16Compression(),
    BFloat16Compression(),
    Uniform8BitQuantization(),
    Quantile8BitQuantization(),
]


def wire_round_trip(ct: CompressedTensor) -> torch.Tensor:
    header, payload = ct.to_wire()
    header = msgpack.unpackb(msgpack.packb(header), raw=False)  # really msgpack-able
    return extract(CompressedTensor.from_wire(header, bytes(payload)))


@pytest.fixture(scope="module")
def normal() -> torch.Tensor:
    return torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("codec", "bound"),
    [
        (Float16Compression(), 1e-5),
        (ScaledFloat16Compression(), 1e-5),
        (Uniform8BitQuantization(), 1e-2),
        (Quantile8BitQuantization(), 1e-2),
        (BFloat16Compression(), 1e-4),
    ],
)
def test_error_bounds_on_unit_normal(codec, bound: float, normal: torch.Tensor) -> None:
    out = wire_round_trip(codec.compress(normal))
    assert out.dtype == normal.dtype and out.shape == normal.shape
    assert float(((out - normal) ** 2).mean()) <= bound


@pytest.mark.parametrize("codec", ALL, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5),
        torch.empty(0, 4),
        torch.ones(1),
        torch.randn(3, 5, 7).double(),
        torch.arange(6).view(2, 3),
        torch.randn(4).half(),
    ],
    ids=["0d", "empty", "one", "f64", "int", "f16"],
)
def test_shapes_and_dtypes_survive(codec, tensor: torch.Tensor) -> None:
    out = wire_round_trip(codec.compress(tensor))
    assert out.shape == tensor.shape and out.dtype == tensor.dtype
    if not tensor.is_floating_point():
        assert torch.equal(out, tensor)  # non-float tensors travel uncompressed
    else:
        torch.testing.assert_close(out.double(), tensor.double(), atol=0.05, rtol=0.05)


def test_no_compression_is_zero_copy_both_ways() -> None:
    x = torch.randn(10)
    ct = NoCompression().compress(x)
    x[0] = 42.0
    assert torch.frombuffer(bytearray(ct.data), dtype=torch.float32)[0] == 42.0  # a view of x
    header, payload = ct.to_wire()
    y = extract(CompressedTensor.from_wire(header, payload))  # writable payload: no copy
    assert y.data_ptr() == x.data_ptr()
    z = extract(CompressedTensor.from_wire(header, bytes(payload)))  # read-only: one copy
    assert torch.equal(z, x) and z.data_ptr() != x.data_ptr()


def test_fp16_clamps_instead_of_overflowing() -> None:
    out = wire_round_trip(Float16Compression().compress(torch.tensor([1e6, -1e6, 1.0])))
    assert torch.isfinite(out).all() and out[0] == 65504.0


@pytest.mark.parametrize("codec", ALL, ids=lambda c: c.name)
def test_wrong_length_raises(codec) -> None:
    header, payload = codec.compress(torch.randn(16)).to_wire()
    with pytest.raises(CompressionError, match="payload"):
        CompressedTensor.from_wire(header, bytes(payload)[:-1])
    with pytest.raises(CompressionError):
        CompressedTensor.from_wire(header, bytes(payload) + b"\0")


def test_nan_and_inf_payloads_raise() -> None:
    for bad in (math.nan, math.inf):
        header, payload = NoCompression().compress(torch.tensor([1.0, bad])).to_wire()
        ct = CompressedTensor.from_wire(header, bytes(payload))
        with pytest.raises(CompressionError, match="NaN or Inf"):
            extract(ct)
    header, payload = Float16Compression().compress(torch.ones(2)).to_wire()
    with pytest.raises(CompressionError):
        extract(
            CompressedTensor.from_wire(
                header, torch.tensor([1.0, math.nan]).half().numpy().tobytes()
            )
        )
    header, payload = Uniform8BitQuantization().compress(torch.ones(2)).to_wire()
    header["meta"]["min"] = math.nan
    with pytest.raises(CompressionError, match="finite"):
        CompressedTensor.from_wire(header, payload)
    header, payload = Quantile8BitQuantization().compress(torch.randn(300)).to_wire()
    header["meta"]["codebook"] = torch.full((256,), math.inf).numpy().tobytes()
    with pytest.raises(CompressionError):
        extract(CompressedTensor.from_wire(header, payload))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: h.update(codec="gzip"),
        lambda h: h.update(dtype="complex64"),
        lambda h: h.update(dtype=3),
        lambda h: h.update(shape=[-1]),
        lambda h: h.update(shape=[True, 4]),
        lambda h: h.update(shape="4"),
        lambda h: h.update(meta={"mean": 0.0}),
        lambda h: h.update(extra=1),
        lambda h: h.pop("meta"),
        lambda h: h.update(codec="float16", dtype="int64"),
    ],
)
def test_malformed_headers_raise(mutate) -> None:
    header, payload = NoCompression().compress(torch.zeros(4)).to_wire()
    mutate(header)
    with pytest.raises(CompressionError):
        CompressedTensor.from_wire(header, payload)


def test_compression_error_is_a_value_error() -> None:
    assert issubclass(CompressionError, ValueError)


def test_wrappers_select_by_size_key_and_role() -> None:
    small, big = torch.randn(10), torch.randn(1000)
    adaptive = SizeAdaptiveCompression(100, NoCompression(), Uniform8BitQuantization())
    assert adaptive.compress(small, CompressionInfo.from_tensor(small)).codec == "none"
    assert adaptive.compress(big, CompressionInfo.from_tensor(big)).codec == "uniform_8bit"
    assert adaptive.estimate_compression_ratio(CompressionInfo.from_tensor(big)) == 0.25
    per = PerTensorCompression([Float16Compression(), adaptive])
    assert per.compress(big, CompressionInfo.from_tensor(big, key=0)).codec == "float16"
    assert per.compress(big, CompressionInfo.from_tensor(big, key=1)).codec == "uniform_8bit"
    with pytest.raises(ValueError):
        per.compress(big, CompressionInfo.from_tensor(big, key=2))
    role = RoleAdaptiveCompression(
        gradient=Float16Compression(), optimizer=Quantile8BitQuantization()
    )
    info = CompressionInfo.from_tensor(big, role=TensorRole.OPTIMIZER)
    assert role.compress(big, info).codec == "quantile_8bit"
    assert (
        role.compress(big, CompressionInfo.from_tensor(big, role=TensorRole.PARAMETER)).codec
        == "none"
    )
    assert role.spec() != RoleAdaptiveCompression().spec()
    assert adaptive == SizeAdaptiveCompression(100, NoCompression(), Uniform8BitQuantization())


def test_extract_from_any_codec_instance() -> None:
    x = torch.randn(8)
    ct = Float16Compression().compress(x)
    torch.testing.assert_close(NoCompression().extract(ct), x, atol=1e-3, rtol=1e-3)


def test_plain_values_is_a_zero_copy_shortcut_for_exactly_the_plain_1d_case() -> None:
    x = torch.randn(10)
    header, _ = NoCompression().compress(x).to_wire()
    payload = memoryview(bytearray(x.numpy().tobytes()))  # writable, as lanes deliver
    values = plain_values(header, payload, torch.float32)
    assert values is not None and torch.equal(values, x)
    values[0] = 7.0  # over the payload itself
    assert payload.cast("f")[0] == 7.0
    others = {
        "read-only payload": (header, x.numpy().tobytes(), torch.float32),
        "other dtype": (header, payload, torch.float64),
        "short payload": (header, payload[:-4], torch.float32),
        "2-d shape": ({**header, "shape": [2, 5]}, payload, torch.float32),
        "bool shape": ({**header, "shape": [True]}, payload[:4], torch.float32),
        "empty": ({**header, "shape": [0]}, memoryview(bytearray()), torch.float32),
        "meta": ({**header, "meta": {"x": 1}}, payload, torch.float32),
        "extra key": ({**header, "k": 1}, payload, torch.float32),
        "other codec": ({**header, "codec": "float16"}, payload, torch.float32),
    }
    for case, (h, p, dtype) in others.items():
        assert plain_values(h, p, dtype) is None, case
