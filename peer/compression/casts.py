"""Codecs that cast: the tensor's own bytes, half precision (plain or standardised) and
bfloat16."""

from __future__ import annotations

import math

import torch

from peer.compression.base import (
    PLAIN,
    CompressedTensor,
    Compression,
    MetaValue,
    byte_view,
    from_payload,
)


class NoCompression(Compression):
    """Send the tensor's own bytes; zero-copy for a contiguous CPU tensor."""

    name = PLAIN

    def applies_to(self, dtype: torch.dtype) -> bool:
        return True

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], bytes | memoryview]:
        return {}, byte_view(tensor)

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        return from_payload(compressed.data, dtype, compressed.numel)


_FP16_MAX = float(torch.finfo(torch.float16).max)


class Float16Compression(Compression):
    """Cast to IEEE half precision; values beyond ±65504 are clamped, not sent as Inf."""

    name = "float16"
    float_payload_itemsize = 2
    target_dtype = torch.float16

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], bytes | memoryview]:
        # clamp after the cast: overflowed values became ±inf and clamp maps them to ±max
        half = tensor.to(torch.float16).clamp_(-_FP16_MAX, _FP16_MAX)
        return {}, byte_view(half)

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        return from_payload(compressed.data, torch.float16, compressed.numel).to(dtype)


class ScaledFloat16Compression(Compression):
    """Standardise with the tensor's mean and std, then cast to half precision.

    Keeps relative precision for tensors whose scale is far from 1 (tiny gradients, large
    parameters), where plain fp16 would underflow or clamp. One mean/std per tensor (or part).
    """

    name = "scaled_float16"
    float_payload_itemsize = 2
    meta_fields = {"mean": float, "std": float}

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], bytes | memoryview]:
        work = tensor if tensor.dtype == torch.float64 else tensor.float()  # [numel...]
        if work.numel() == 0:
            return {"mean": 0.0, "std": 1.0}, b""
        mean = float(work.mean())
        std = float(work.std(unbiased=False)) if work.numel() > 1 else 0.0
        if not math.isfinite(std) or std == 0.0:
            std = 1.0  # constant tensor: anything works; 1 keeps the maths trivial
        half = ((work - mean) / std).to(torch.float16).clamp_(-_FP16_MAX, _FP16_MAX)
        return {"mean": mean, "std": std}, byte_view(half)

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        half = from_payload(compressed.data, torch.float16, compressed.numel)
        work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        out = (
            half.to(work_dtype)
            .mul_(float(compressed.meta["std"]))
            .add_(float(compressed.meta["mean"]))
        )
        return out.to(dtype)


class BFloat16Compression(Compression):
    """Cast to bfloat16: fp32's range with 8 bits of mantissa."""

    name = "bfloat16"
    float_payload_itemsize = 2
    target_dtype = torch.bfloat16

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], bytes | memoryview]:
        return {}, byte_view(tensor.to(torch.bfloat16))

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        return from_payload(compressed.data, torch.bfloat16, compressed.numel).to(dtype)
