"""Tensor codecs for averaging and state transfer (protocol logic, no I/O).

Names and meanings follow ``hivemind.compression`` so a seed user recognises them:

==============================  ==============================  =========================
codec                           wire name                       payload bytes / element
==============================  ==============================  =========================
:class:`NoCompression`          ``none``                        ``itemsize`` of the dtype
:class:`Float16Compression`     ``float16``                     2
:class:`ScaledFloat16Compression` ``scaled_float16`` (mean/std) 2
:class:`BFloat16Compression`    ``bfloat16``                    2
:class:`Uniform8BitQuantization` ``uniform_8bit`` (min/step)    1
:class:`Quantile8BitQuantization` ``quantile_8bit`` (codebook)  1
:class:`Blockwise8BitQuantization` ``blockwise_8bit``         1 + 4 per 256 (scales)
:class:`Blockwise4BitQuantization` ``blockwise_4bit``         1/2 + 4 per 128 (scales)
==============================  ==============================  =========================

:func:`compression_from_name` gives a codec for a run's configuration by a short name
(``none``, ``float16``/``fp16``, ``bfloat16``/``bf16``, ``int8``, ``int4``, or any wire name).

Wrappers pick one of those per tensor from its :class:`CompressionInfo`:
:class:`SizeAdaptiveCompression`, :class:`PerTensorCompression`,
:class:`RoleAdaptiveCompression`.

A codec turns a tensor into a :class:`CompressedTensor` (codec name, dtype, shape, small
``meta`` dict, raw ``data`` buffer). :meth:`CompressedTensor.to_wire` splits it into
msgpack-able header fields and the raw payload; :meth:`CompressedTensor.from_wire` validates
both strictly and :func:`extract` decodes, so the receiver never needs to know which codec
the sender was configured with: the wire name says. Anything malformed — unknown codec, bad
dtype or shape, wrong payload length, missing or non-finite meta, NaN/Inf in the decoded
values — raises :class:`CompressionError` (a ``ValueError``), which the networked layer treats
as grounds to exclude the sender. Nothing is ever unpickled.

Copies: :class:`NoCompression` of a contiguous CPU tensor hands out a zero-copy view of the
tensor's memory, and :func:`extract` of a ``none`` payload is zero-copy when the payload is
*writable* (``bytearray`` or a memoryview of one); a read-only ``bytes`` payload is copied
once, because torch has no read-only tensors. Lossy codecs copy by nature.

Byte order is little-endian (every platform torch ships wheels for); payloads are the
tensors' native bytes.

Lossy codecs apply to floating-point tensors only; any other dtype (and a tensor that is
already in the target dtype) is sent with ``none`` — the wire name records what was done.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from peer.exceptions import SwarmgradError

__all__ = [
    "BFloat16Compression",
    "Blockwise4BitQuantization",
    "Blockwise8BitQuantization",
    "CompressedTensor",
    "Compression",
    "CompressionError",
    "CompressionInfo",
    "Float16Compression",
    "NoCompression",
    "PerTensorCompression",
    "Quantile8BitQuantization",
    "RoleAdaptiveCompression",
    "ScaledFloat16Compression",
    "SizeAdaptiveCompression",
    "TensorDescriptor",
    "TensorRole",
    "Uniform8BitQuantization",
    "all_finite",
    "byte_view",
    "compression_from_name",
    "dtype_from_name",
    "dtype_name",
    "extract",
    "plain_values",
]


class CompressionError(SwarmgradError, ValueError):
    """A compressed tensor is malformed or decodes to non-finite values.

    Raised on the receiving side; the networked layer excludes the peer that sent it.
    """


# ---------------------------------------------------------------------------- dtypes

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}

#: Hard limit on tensor rank accepted from the wire (torch itself allows 64).
MAX_NDIM = 32


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.float32`` → ``"float32"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be sent over the wire") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; :class:`CompressionError` if unknown."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CompressionError(f"unknown dtype {name!r}") from None


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


# ------------------------------------------------------------------ info and result


class TensorRole(enum.Enum):
    """What a tensor is, for :class:`RoleAdaptiveCompression` (hivemind's ``TensorRole``)."""

    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER = "optimizer"
    ACTIVATION = "activation"
    UNSPECIFIED = "unspecified"


@dataclass(frozen=True)
class TensorDescriptor:
    """Shape and dtype of a whole tensor (not of a part of it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorDescriptor:
        return cls(tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class CompressionInfo:
    """What a wrapper codec may look at to choose a codec for one tensor.

    ``key`` identifies the tensor (its index in the averaged list, or a name) for
    :class:`PerTensorCompression`; ``descriptor`` describes the *whole* tensor, so a
    size-adaptive choice is the same for every part of it.
    """

    key: Hashable
    descriptor: TensorDescriptor
    role: TensorRole = TensorRole.UNSPECIFIED

    @classmethod
    def from_tensor(
        cls, tensor: torch.Tensor, key: Hashable = 0, role: TensorRole = TensorRole.UNSPECIFIED
    ) -> CompressionInfo:
        return cls(key, TensorDescriptor.from_tensor(tensor), role)


MetaValue = int | float | bytes


@dataclass(frozen=True)
class CompressedTensor:
    """One compressed tensor: what a codec produced and :func:`extract` consumes.

    ``data`` is the raw payload (often a zero-copy memoryview of a tensor's memory: keep the
    object alive and do not mutate the source tensor until it has been sent). ``meta`` holds
    the codec's msgpack-able scalars (floats, ints, bytes).
    """

    codec: str
    dtype: str
    shape: tuple[int, ...]
    meta: Mapping[str, MetaValue] = field(default_factory=dict)
    data: bytes | bytearray | memoryview = b""
    _checked: bool = field(default=False, repr=False, compare=False, kw_only=True)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the raw payload in bytes."""
        return memoryview(self.data).nbytes

    def to_wire(self) -> tuple[dict[str, Any], bytes | bytearray | memoryview]:
        """Split into msgpack-able header fields and the raw payload (no copy)."""
        header = {
            "codec": self.codec,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "meta": dict(self.meta),
        }
        return header, self.data

    @classmethod
    def from_wire(
        cls, header: Mapping[str, Any], payload: bytes | bytearray | memoryview
    ) -> CompressedTensor:
        """Rebuild from :meth:`to_wire` output received from a peer, validating everything.

        Checks the header's keys and types, that the codec and dtype are known and fit each
        other, that ``meta`` holds exactly the codec's fields with finite values, and that the
        payload length matches the shape. Raises :class:`CompressionError` otherwise.
        NaN/Inf in the values themselves are caught by :func:`extract`.
        """
        # (``type(...) is dict`` first: the ABC check is slow, and received headers are dicts)
        if type(header) is not dict and not isinstance(header, Mapping):
            raise CompressionError("compressed tensor header must be a map")
        if set(header) != {"codec", "dtype", "shape", "meta"}:
            raise CompressionError(
                f"bad compressed tensor header fields {sorted(map(str, header))}"
            )
        codec_name, dtype_str, shape, meta = (
            header["codec"],
            header["dtype"],
            header["shape"],
            header["meta"],
        )
        if not isinstance(codec_name, str) or codec_name not in _LEAF_CODECS:
            raise CompressionError(f"unknown codec {codec_name!r}")
        codec = _LEAF_CODECS[codec_name]
        dtype = dtype_from_name(dtype_str)
        if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
            raise CompressionError(f"bad shape {shape!r}")
        for dim in shape:
            # bool is an int subclass; a shape of True/False is malformed, not 1/0
            if type(dim) is not int or dim < 0:
                raise CompressionError(f"bad shape {shape!r}")
        if type(meta) is not dict and not isinstance(meta, Mapping):
            raise CompressionError("meta must be a map")
        codec._validate_meta(meta, dtype)
        try:
            view = memoryview(payload)
        except TypeError:
            raise CompressionError("payload is not a bytes-like object") from None
        numel = math.prod(shape)
        expected = codec._payload_nbytes_checked(numel, dtype)
        if view.nbytes != expected:
            raise CompressionError(
                f"payload of {view.nbytes} bytes for {codec_name} {dtype_str}{list(shape)}, "
                f"expected {expected}"
            )
        return cls(codec_name, dtype_str, tuple(shape), dict(meta), payload, _checked=True)


# ------------------------------------------------------------------------- helpers


def byte_view(tensor: torch.Tensor) -> memoryview:
    """Zero-copy memoryview of a contiguous CPU tensor's bytes (format ``B``)."""
    # shape [numel] of uint8 items; the numpy array keeps the tensor alive
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def plain_values(header: Any, payload: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """The values of a received uncompressed 1-d ``dtype`` tensor (``none`` codec) as a
    tensor over ``payload``, without a copy, if the header is exactly that and the payload
    a writable buffer of the right size; else None (then :meth:`CompressedTensor.from_wire`
    and :func:`extract` decide, with their errors). Values are not checked for NaN/Inf. A
    shortcut for the frames a round receives most."""
    if type(header) is not dict or len(header) != 4 or header.get("codec") != NoCompression.name:
        return None
    shape, meta = header.get("shape"), header.get("meta")
    if header.get("dtype") != dtype_name(dtype) or type(meta) is not dict or meta:
        return None
    if type(shape) is not list or len(shape) != 1 or type(shape[0]) is not int:
        return None
    view = payload if type(payload) is memoryview else memoryview(payload)
    if view.readonly or not shape[0] or view.nbytes != shape[0] * dtype.itemsize:
        return None
    return torch.frombuffer(view, dtype=dtype)


def _from_payload(payload: bytes | bytearray | memoryview, dtype: torch.dtype, numel: int):
    """A 1-d tensor over the payload: zero-copy if writable, one copy if read-only."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    view = memoryview(payload)
    if view.readonly:
        # torch has no read-only tensors and would warn (and alias) otherwise
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=dtype, count=numel)


def _prepare(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has no NaN/Inf.

    Fast path for fp32/fp64: ``x·x`` is one vectorised BLAS reduction without a temporary
    (much faster than ``isfinite(x).all()`` or even ``x.sum()`` on CPU); a finite result
    implies finite elements, since NaN and ±Inf propagate. Only a non-finite result (bad
    values, or squares overflowing) pays for the exact element-wise test."""
    if not tensor.is_floating_point() or not tensor.numel():
        return True
    if tensor.dtype in (torch.float32, torch.float64):
        flat = tensor.reshape(-1)
        if math.isfinite(float(torch.dot(flat, flat))):
            return True
    return bool(torch.isfinite(tensor).all())


def _check_finite(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    if not all_finite(tensor):
        raise CompressionError(f"{codec} payload decodes to NaN or Inf")
    return tensor


def _meta_float(meta: Mapping[str, Any], key: str) -> float:
    value = meta[key]
    if type(value) not in (float, int) or not math.isfinite(value):
        raise CompressionError(f"meta field {key!r} must be a finite number, got {value!r}")
    return float(value)


# -------------------------------------------------------------------------- codecs


class Compression:
    """Base of every codec.

    Subclasses that are *leaf* codecs set ``name``, ``meta_fields`` and implement
    ``_encode``/``_decode``; wrappers override :meth:`select` only.
    """

    name: ClassVar[str] = ""
    #: meta key → required type; exactly these keys must be present on the wire
    meta_fields: ClassVar[Mapping[str, type]] = {}
    #: bytes per element of the payload for floating-point inputs (None: the dtype's size)
    float_payload_itemsize: ClassVar[int | None] = None
    #: a floating input already of this dtype is sent as ``none`` (nothing to gain)
    target_dtype: ClassVar[torch.dtype | None] = None

    # ---- choosing

    def select(self, info: CompressionInfo | None) -> Compression:
        """The leaf codec used for a tensor described by ``info`` (a leaf returns itself)."""
        return self

    def spec(self) -> str:
        """A stable description, part of a group's schema hash (peers must agree on it)."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Compression)
            and type(self) is type(other)
            and self.spec() == other.spec()
        )

    def __hash__(self) -> int:
        return hash((type(self), self.spec()))

    # ---- sizing

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether this leaf codec transforms ``dtype`` (else ``none`` is used)."""
        return dtype.is_floating_point and dtype != self.target_dtype

    def payload_itemsize(self, dtype: torch.dtype, info: CompressionInfo | None = None) -> int:
        """Exact payload bytes per element when compressing a tensor of ``dtype``."""
        leaf = self.select(info)
        if leaf is not self:
            return leaf.payload_itemsize(dtype)
        if self.float_payload_itemsize is None or not self.applies_to(dtype):
            return _itemsize(dtype)
        return self.float_payload_itemsize

    def payload_nbytes(
        self, numel: int, dtype: torch.dtype, info: CompressionInfo | None = None
    ) -> int:
        """Exact payload bytes of a compressed tensor of ``numel`` elements of ``dtype``
        (codecs whose payload is not a whole number of bytes per element override it)."""
        leaf = self.select(info)
        if leaf is not self:
            return leaf.payload_nbytes(numel, dtype)
        return numel * self.payload_itemsize(dtype)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Compressed payload size / raw size for the tensor ``info`` describes.

        Exact for the payload (the header adds a few dozen bytes per part, the quantile
        codebook 1 KiB); load balancing and part sizing use it to count compressed bytes.
        """
        dtype = info.descriptor.dtype
        numel = info.descriptor.numel
        if not numel:
            return self.payload_itemsize(dtype, info) / _itemsize(dtype)
        return self.payload_nbytes(numel, dtype, info) / (numel * _itemsize(dtype))

    # ---- coding

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None
    ) -> CompressedTensor:
        """Compress ``tensor`` (any shape); see :class:`CompressedTensor` on aliasing."""
        leaf = self.select(info)
        if leaf is not self:
            return leaf.compress(tensor, info)
        tensor = _prepare(tensor)
        if not self.applies_to(tensor.dtype):
            return _NONE._encode_checked(tensor)
        return self._encode_checked(tensor)

    def extract(self, compressed: CompressedTensor) -> torch.Tensor:
        """Decode ``compressed`` (whatever codec produced it, per its wire name)."""
        return extract(compressed)

    def _encode_checked(self, tensor: torch.Tensor) -> CompressedTensor:
        meta, data = self._encode(tensor)
        return CompressedTensor(
            self.name, dtype_name(tensor.dtype), tuple(tensor.shape), meta, data
        )

    # Leaf codecs override these two; wrappers delegate through select() and never get here.
    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], Any]:
        raise TypeError(
            f"{type(self).__name__} does not encode itself; select() picks a leaf codec"
        )

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        raise TypeError(
            f"{type(self).__name__} does not decode itself; extract() picks by wire name"
        )

    # ---- validation of received data

    def _payload_nbytes_checked(self, numel: int, dtype: torch.dtype) -> int:
        if self.name != NoCompression.name and not self.applies_to(dtype):
            raise CompressionError(f"codec {self.name} cannot carry dtype {dtype_name(dtype)}")
        return self.payload_nbytes(numel, dtype)

    def _validate_meta(self, meta: Mapping[str, Any], dtype: torch.dtype) -> None:
        if set(meta) != set(self.meta_fields):
            raise CompressionError(
                f"codec {self.name} needs meta fields {sorted(self.meta_fields)}, got {sorted(map(str, meta))}"
            )
        for key, kind in self.meta_fields.items():
            if kind is float:
                _meta_float(meta, key)
            elif not isinstance(meta[key], kind):
                raise CompressionError(f"meta field {key!r} must be {kind.__name__}")


class NoCompression(Compression):
    """Send the tensor's own bytes; zero-copy for a contiguous CPU tensor."""

    name = "none"

    def applies_to(self, dtype: torch.dtype) -> bool:
        return True

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], Any]:
        return {}, byte_view(tensor)

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        return _from_payload(compressed.data, dtype, compressed.numel)


_FP16_MAX = float(torch.finfo(torch.float16).max)


class Float16Compression(Compression):
    """Cast to IEEE half precision; values beyond ±65504 are clamped, not sent as Inf."""

    name = "float16"
    float_payload_itemsize = 2
    target_dtype = torch.float16

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], Any]:
        # clamp after the cast: overflowed values became ±inf and clamp maps them to ±max
        half = tensor.to(torch.float16).clamp_(-_FP16_MAX, _FP16_MAX)
        return {}, byte_view(half)

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        return _from_payload(compressed.data, torch.float16, compressed.numel).to(dtype)


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

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], Any]:
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
        half = _from_payload(compressed.data, torch.float16, compressed.numel)
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

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], Any]:
        return {}, byte_view(tensor.to(torch.bfloat16))

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        return _from_payload(compressed.data, torch.bfloat16, compressed.numel).to(dtype)


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

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], Any]:
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
        codes = _from_payload(compressed.data, torch.uint8, compressed.numel)
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

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], Any]:
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

    def _validate_meta(self, meta: Mapping[str, Any], dtype: torch.dtype) -> None:
        super()._validate_meta(meta, dtype)
        if len(meta["codebook"]) != self._CODEBOOK_BYTES:
            raise CompressionError(f"quantile codebook must be {self._CODEBOOK_BYTES} bytes")

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        codebook = _from_payload(compressed.meta["codebook"], torch.float32, 256)  # type: ignore[arg-type]
        _check_finite(codebook, self.name)
        codes = _from_payload(compressed.data, torch.uint8, compressed.numel)
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
            return numel * _itemsize(dtype)
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
        scales = _from_payload(payload[self._code_bytes(numel) :], torch.float32, blocks)
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

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], Any]:
        codes, scales = self._quantize(tensor)
        return {}, byte_view(codes.to(torch.int8)).tobytes() + byte_view(scales).tobytes()

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        data = memoryview(compressed.data)[: compressed.numel]
        codes = _from_payload(data, torch.int8, compressed.numel).to(torch.int16)
        return self._dequantize(codes, compressed, dtype)


class Blockwise4BitQuantization(_BlockwiseQuantization):
    """Signed 4-bit codes (-7..7), two per byte (low nibble first, stored as code + 8), per
    block of 128 elements with a float32 scale each: 0.53 bytes per element."""

    name = "blockwise_4bit"
    block = 128
    levels = 7

    def _code_bytes(self, numel: int) -> int:
        return -(-numel // 2)

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], Any]:
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
        packed = _from_payload(data, torch.uint8, self._code_bytes(numel))
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel]
        return self._dequantize(nibbles.to(torch.int16) - 8, compressed, dtype)


# -------------------------------------------------------------------------- wrappers


class SizeAdaptiveCompression(Compression):
    """``less`` for tensors with fewer than ``threshold`` elements, else ``greater_equal``."""

    def __init__(self, threshold: int, less: Compression, greater_equal: Compression) -> None:
        if threshold < 0:
            raise ValueError("threshold must be non-negative")
        self.threshold, self.less, self.greater_equal = threshold, less, greater_equal

    def select(self, info: CompressionInfo | None) -> Compression:
        if info is None:
            raise ValueError("SizeAdaptiveCompression needs a CompressionInfo to choose")
        codec = self.less if info.descriptor.numel < self.threshold else self.greater_equal
        return codec.select(info)

    def spec(self) -> str:
        return f"size_adaptive({self.threshold},{self.less.spec()},{self.greater_equal.spec()})"

    def __repr__(self) -> str:
        return f"SizeAdaptiveCompression({self.threshold}, {self.less!r}, {self.greater_equal!r})"


class PerTensorCompression(Compression):
    """One codec per tensor, chosen by ``info.key`` (an index into a list, or a mapping key)."""

    def __init__(self, codecs: Sequence[Compression] | Mapping[Hashable, Compression]) -> None:
        self.codecs = codecs

    def select(self, info: CompressionInfo | None) -> Compression:
        if info is None:
            raise ValueError("PerTensorCompression needs a CompressionInfo to choose")
        try:
            codec = self.codecs[info.key]  # type: ignore[call-overload]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"no codec for tensor key {info.key!r}") from None
        return codec.select(info)

    def spec(self) -> str:
        if isinstance(self.codecs, Mapping):
            items = ",".join(f"{k!r}:{c.spec()}" for k, c in sorted(self.codecs.items(), key=repr))
        else:
            items = ",".join(c.spec() for c in self.codecs)
        return f"per_tensor({items})"

    def __repr__(self) -> str:
        return f"PerTensorCompression({self.codecs!r})"


class RoleAdaptiveCompression(Compression):
    """One codec per :class:`TensorRole`; roles not given use ``default``."""

    def __init__(
        self,
        *,
        activation: Compression | None = None,
        parameter: Compression | None = None,
        gradient: Compression | None = None,
        optimizer: Compression | None = None,
        default: Compression | None = None,
    ) -> None:
        self.default = default if default is not None else NoCompression()
        self.by_role: dict[TensorRole, Compression] = {
            role: codec if codec is not None else self.default
            for role, codec in (
                (TensorRole.ACTIVATION, activation),
                (TensorRole.PARAMETER, parameter),
                (TensorRole.GRADIENT, gradient),
                (TensorRole.OPTIMIZER, optimizer),
                (TensorRole.UNSPECIFIED, None),
            )
        }

    def select(self, info: CompressionInfo | None) -> Compression:
        role = TensorRole.UNSPECIFIED if info is None else info.role
        return self.by_role[role].select(info)

    def spec(self) -> str:
        return (
            "role_adaptive("
            + ",".join(f"{r.value}:{c.spec()}" for r, c in self.by_role.items())
            + ")"
        )

    def __repr__(self) -> str:
        return f"RoleAdaptiveCompression({self.by_role!r})"


# ------------------------------------------------------------------------ registry

_NONE = NoCompression()
_LEAF_CODECS: dict[str, Compression] = {
    codec.name: codec
    for codec in (
        _NONE,
        Float16Compression(),
        ScaledFloat16Compression(),
        BFloat16Compression(),
        Uniform8BitQuantization(),
        Quantile8BitQuantization(),
        Blockwise8BitQuantization(),
        Blockwise4BitQuantization(),
    )
}

_SHORT_NAMES: dict[str, str] = {
    "fp16": "float16",
    "bf16": "bfloat16",
    "int8": Blockwise8BitQuantization.name,
    "int4": Blockwise4BitQuantization.name,
}


def compression_from_name(name: str) -> Compression:
    """The codec a run's configuration names: ``none``, ``float16`` (``fp16``),
    ``bfloat16`` (``bf16``), ``int8`` (:class:`Blockwise8BitQuantization`), ``int4``
    (:class:`Blockwise4BitQuantization`), or any codec's wire name. ``ValueError`` naming
    the choices otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"a compression name must be a string, got {type(name).__name__}")
    key = _SHORT_NAMES.get(name.strip().lower(), name.strip().lower())
    if key not in _LEAF_CODECS:
        choices = sorted({*_SHORT_NAMES, *_LEAF_CODECS})
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(choices)}")
    return type(_LEAF_CODECS[key])()


def extract(compressed: CompressedTensor, *, check_finite: bool = True) -> torch.Tensor:
    """Decode a :class:`CompressedTensor` into a tensor of its original dtype and shape.

    Validates the fields first (as :meth:`CompressedTensor.from_wire` does, so a value built
    by hand is checked too) and, with ``check_finite``, that a floating result has no NaN/Inf.
    Raises :class:`CompressionError` on any problem. The result may alias a writable payload.
    """
    # built by from_wire: already validated (the flag cannot survive a change: frozen)
    checked = (
        compressed if compressed._checked else CompressedTensor.from_wire(*compressed.to_wire())
    )
    codec = _LEAF_CODECS[checked.codec]
    dtype = _DTYPES[checked.dtype]
    flat = codec._decode(checked, dtype)  # [numel]
    out = flat.reshape(checked.shape)
    return _check_finite(out, checked.codec) if check_finite else out
