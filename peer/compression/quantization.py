"""Codecs that quantise to 8 or 4 bits: uniform levels, levels at the quantiles, and
symmetric levels per block with a scale each."""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from typing import ClassVar

import torch

from peer.compression.base import (
    CompressedTensor,
    Compression,
    CompressionError,
    CompressionInfo,
    MetaValue,
    all_finite,
    byte_view,
    from_payload,
    itemsize,
    require_finite,
)


class Uniform8BitQuantization(Compression):
    """256 evenly spaced levels between the tensor's min and max.

    Error per element ≤ half a step, step = (max - min)/255; on unit-normal data the MSE is
    about step²/12 ≈ 1e-4. Outliers widen the step: prefer the quantile codec for heavy tails.
    """

    name = "uniform_8bit"
    float_payload_itemsize = 1
    meta_fields = {"min": float, "step": float}

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], bytes | memoryview]:
        if tensor.numel() == 0:
            return {"min": 0.0, "step": 0.0}, b""
        work = tensor if tensor.dtype == torch.float64 else tensor.float()
        lo, hi = float(work.min()), float(work.max())
        step = (hi - lo) / 255.0
        if step > 0.0 and math.isfinite(step):
            codes = ((work - lo) / step).round_().clamp_(0, 255).to(torch.uint8)
        else:
            step = 0.0
            codes = torch.zeros(work.shape, dtype=torch.uint8)
        return {"min": lo, "step": step}, byte_view(codes)

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        codes = from_payload(compressed.data, torch.uint8, compressed.numel)
        work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        out = codes.to(work_dtype).mul_(float(compressed.meta["step"]))
        return out.add_(float(compressed.meta["min"])).to(dtype)


class Quantile8BitQuantization(Compression):
    """256 levels placed at the tensor's quantiles, each level the mean of its bucket.

    Bucket edges are the 1/256 … 255/256 quantiles of (a strided sample of at most
    ``max_sample`` elements of) the tensor; each code's value is the mean of the elements that
    fell in its bucket, i.e. one Lloyd step from quantile initialisation, so dense regions
    get fine levels. The codebook (256 float32) travels in ``meta``.
    """

    name = "quantile_8bit"
    float_payload_itemsize = 1
    meta_fields = {"codebook": bytes}
    max_sample = 1 << 20
    _CODEBOOK_BYTES = 256 * 4

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], bytes | memoryview]:
        flat = tensor.reshape(-1).float()  # [numel]
        codebook = torch.zeros(256, dtype=torch.float32)
        if flat.numel() == 0:
            return {"codebook": byte_view(codebook).tobytes()}, b""
        stride = max(1, flat.numel() // self.max_sample)
        sample = flat[::stride].sort().values  # [<= max_sample]
        positions = (torch.arange(1, 256) * sample.numel()) // 256  # [255]
        edges = sample[positions.clamp_(max=sample.numel() - 1)].contiguous()  # [255], sorted
        codes = torch.bucketize(flat, edges, right=True)  # [numel] int64 in 0..255
        sums = torch.zeros(256, dtype=torch.float64).index_add_(0, codes, flat.double())
        counts = torch.bincount(codes, minlength=256).double()
        # empty buckets never occur in the payload; give them a finite placeholder
        codebook = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).float()
        return {"codebook": byte_view(codebook).tobytes()}, byte_view(codes.to(torch.uint8))

    def _validate_meta(self, meta: Mapping[str, object], dtype: torch.dtype) -> None:
        super()._validate_meta(meta, dtype)
        codebook = meta["codebook"]  # bytes: checked by the base class
        if not isinstance(codebook, bytes) or len(codebook) != self._CODEBOOK_BYTES:
            raise CompressionError(f"quantile codebook must be {self._CODEBOOK_BYTES} bytes")

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        codebook = from_payload(compressed.meta["codebook"], torch.float32, 256)  # type: ignore[arg-type]
        require_finite(codebook, self.name)
        codes = from_payload(compressed.data, torch.uint8, compressed.numel)
        return codebook[codes.long()].to(dtype)


class _BlockwiseQuantization(Compression):
    """Symmetric quantisation in blocks of ``block`` elements, each with its own scale
    (its largest magnitude / ``levels``): an outlier only coarsens its own block. The
    payload is the codes, then one float32 scale per block."""

    block: ClassVar[int]
    levels: ClassVar[int]  # codes are integers in [-levels, levels]
    float_payload_itemsize = 1  # (whole bytes per element, for part sizing: an upper bound)

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    @abc.abstractmethod
    def _code_bytes(self, numel: int) -> int:
        """Bytes of the codes of ``numel`` elements (each codec packs them its own way)."""

    def payload_nbytes(
        self, numel: int, dtype: torch.dtype, info: CompressionInfo | None = None
    ) -> int:
        if not self.applies_to(dtype):
            return numel * itemsize(dtype)
        return self._code_bytes(numel) + 4 * (-(-numel // self.block))

    def _quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes [numel] (int16, in [-levels, levels]) and scales [blocks] (float32)."""
        flat = tensor.reshape(-1).float()  # [numel]
        numel = flat.numel()
        blocks = -(-numel // self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32)
        padded[:numel] = flat
        grid = padded.view(blocks, self.block)  # [blocks, block]
        scales = grid.abs().amax(dim=1) / self.levels  # [blocks]
        scales = torch.where(torch.isfinite(scales), scales, torch.zeros_like(scales))
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (grid / safe[:, None]).round_().clamp_(-self.levels, self.levels)
        return codes.reshape(-1)[:numel].to(torch.int16), scales

    def _dequantize(
        self, codes: torch.Tensor, compressed: CompressedTensor, dtype: torch.dtype
    ) -> torch.Tensor:
        numel = compressed.numel
        blocks = -(-numel // self.block)
        payload = memoryview(compressed.data)
        scales = from_payload(payload[self._code_bytes(numel) :], torch.float32, blocks)
        if not all_finite(scales) or bool((scales < 0).any()):
            raise CompressionError(f"{self.name} scales must be finite and non-negative")
        if bool((codes.abs() > self.levels).any()):
            raise CompressionError(f"{self.name} codes must lie in [-{self.levels}, {self.levels}]")
        padded = torch.zeros(blocks * self.block, dtype=torch.float32)
        padded[:numel] = codes.float()
        out = padded.view(blocks, self.block).mul_(scales[:, None]).reshape(-1)[:numel]
        return out.to(dtype)


class Blockwise8BitQuantization(_BlockwiseQuantization):
    """Signed 8-bit codes (-127..127) per block of 256 elements with a float32 scale each:
    1.016 bytes per element; error per element at most half a step of its block."""

    name = "blockwise_8bit"
    block = 256
    levels = 127

    def _code_bytes(self, numel: int) -> int:
        return numel

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], bytes | memoryview]:
        codes, scales = self._quantize(tensor)
        return {}, byte_view(codes.to(torch.int8)).tobytes() + byte_view(scales).tobytes()

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        data = memoryview(compressed.data)[: compressed.numel]
        codes = from_payload(data, torch.int8, compressed.numel).to(torch.int16)
        return self._dequantize(codes, compressed, dtype)


class Blockwise4BitQuantization(_BlockwiseQuantization):
    """Signed 4-bit codes (-7..7), two per byte (low nibble first, stored as code + 8), per
    block of 128 elements with a float32 scale each: 0.53 bytes per element."""

    name = "blockwise_4bit"
    block = 128
    levels = 7

    def _code_bytes(self, numel: int) -> int:
        return -(-numel // 2)

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], bytes | memoryview]:
        codes, scales = self._quantize(tensor)
        nibbles = (codes + 8).to(torch.uint8)  # [numel] in 1..15
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
        pairs = nibbles.view(-1, 2)
        packed = (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous()
        return {}, byte_view(packed).tobytes() + byte_view(scales).tobytes()

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        numel = compressed.numel
        data = memoryview(compressed.data)[: self._code_bytes(numel)]
        packed = from_payload(data, torch.uint8, self._code_bytes(numel))
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel]
        return self._dequantize(nibbles.to(torch.int16) - 8, compressed, dtype)
