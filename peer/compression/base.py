"""What every codec shares (protocol logic, no I/O): the description of a tensor a wrapper
chooses by (:class:`CompressionInfo`), a compressed tensor and its strict check on arrival
(:class:`CompressedTensor`), the :class:`Compression` base, the registry of leaf codecs by
wire name, and :func:`extract`, which decodes by that name."""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from peer.exceptions import SwarmgradError

#: the wire name of the codec that sends a tensor's own bytes
PLAIN = "none"


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


def itemsize(dtype: torch.dtype) -> int:
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

    :meth:`to_wire` splits it into msgpack-able header fields and the raw payload;
    :meth:`from_wire` validates both strictly and :func:`extract` decodes, so the receiver never
    needs to know which codec the sender was configured with: the wire name says. Anything
    malformed — unknown codec, bad dtype or shape, wrong payload length, missing or non-finite
    meta, NaN/Inf in the decoded values — raises :class:`CompressionError` (a ``ValueError``),
    which the networked layer treats as grounds to exclude the sender. Nothing is ever
    unpickled. Byte order is little-endian (every platform torch ships wheels for); payloads are
    the tensors' native bytes.
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

    def to_wire(self) -> tuple[dict[str, object], bytes | bytearray | memoryview]:
        """Split into msgpack-able header fields and the raw payload (no copy)."""
        header: dict[str, object] = {
            "codec": self.codec,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "meta": dict(self.meta),
        }
        return header, self.data

    @classmethod
    def from_wire(
        cls, header: Mapping[str, object], payload: bytes | bytearray | memoryview
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
        if not isinstance(codec_name, str) or codec_name not in LEAF_CODECS:
            raise CompressionError(f"unknown codec {codec_name!r}")
        codec = LEAF_CODECS[codec_name]
        if type(dtype_str) is not str:
            raise CompressionError(f"unknown dtype {dtype_str!r}")
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


def plain_values(
    header: object, payload: bytes | bytearray | memoryview, dtype: torch.dtype
) -> torch.Tensor | None:
    """The values of a received uncompressed 1-d ``dtype`` tensor (``none`` codec) as a
    tensor over ``payload``, without a copy, if the header is exactly that and the payload
    a writable buffer of the right size; else None (then :meth:`CompressedTensor.from_wire`
    and :func:`extract` decide, with their errors). Values are not checked for NaN/Inf. A
    shortcut for the frames a round receives most."""
    if type(header) is not dict or len(header) != 4 or header.get("codec") != PLAIN:
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


def from_payload(
    payload: bytes | bytearray | memoryview, dtype: torch.dtype, numel: int
) -> torch.Tensor:
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


def require_finite(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    if not all_finite(tensor):
        raise CompressionError(f"{codec} payload decodes to NaN or Inf")
    return tensor


def _meta_float(meta: Mapping[str, object], key: str) -> float:
    value = meta[key]
    if (type(value) is float or type(value) is int) and math.isfinite(value):
        return float(value)
    raise CompressionError(f"meta field {key!r} must be a finite number, got {value!r}")


# -------------------------------------------------------------------------- codecs


class Compression:
    """Base of every codec.

    Subclasses that are *leaf* codecs set ``name``, ``meta_fields`` and implement
    ``_encode``/``_decode``; wrappers override :meth:`select` only.

    Lossy codecs apply to floating-point tensors only; any other dtype (and a tensor that is
    already in the target dtype) is sent with ``none`` — the wire name records what was done.

    Lossy codecs apply to floating-point tensors only; any other dtype (and a tensor that is
    already in the target dtype) is sent with ``none`` — the wire name records what was done.
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
            return itemsize(dtype)
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
            return self.payload_itemsize(dtype, info) / itemsize(dtype)
        return self.payload_nbytes(numel, dtype, info) / (numel * itemsize(dtype))

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
            return LEAF_CODECS[PLAIN]._encode_checked(tensor)
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
    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, MetaValue], bytes | memoryview]:
        raise TypeError(
            f"{type(self).__name__} does not encode itself; select() picks a leaf codec"
        )

    def _decode(self, compressed: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        raise TypeError(
            f"{type(self).__name__} does not decode itself; extract() picks by wire name"
        )

    # ---- validation of received data

    def _payload_nbytes_checked(self, numel: int, dtype: torch.dtype) -> int:
        if self.name != PLAIN and not self.applies_to(dtype):
            raise CompressionError(f"codec {self.name} cannot carry dtype {dtype_name(dtype)}")
        return self.payload_nbytes(numel, dtype)

    def _validate_meta(self, meta: Mapping[str, object], dtype: torch.dtype) -> None:
        if set(meta) != set(self.meta_fields):
            raise CompressionError(
                f"codec {self.name} needs meta fields {sorted(self.meta_fields)}, got {sorted(map(str, meta))}"
            )
        for key, kind in self.meta_fields.items():
            if kind is float:
                _meta_float(meta, key)
            elif not isinstance(meta[key], kind):
                raise CompressionError(f"meta field {key!r} must be {kind.__name__}")


# ------------------------------------------------------------------------ registry

#: every leaf codec by wire name: what a receiver decodes with (filled by ``peer.compression``)
LEAF_CODECS: dict[str, Compression] = {}


def register_leaf(codec: Compression) -> None:
    """Make ``codec`` decodable by its wire name."""
    if not codec.name or codec.name in LEAF_CODECS:
        raise ValueError(f"codec name {codec.name!r} is empty or taken")
    LEAF_CODECS[codec.name] = codec


def extract(compressed: CompressedTensor, *, check_finite: bool = True) -> torch.Tensor:
    """Decode a :class:`CompressedTensor` into a tensor of its original dtype and shape.

    Validates the fields first (as :meth:`CompressedTensor.from_wire` does, so a value built
    by hand is checked too) and, with ``check_finite``, that a floating result has no NaN/Inf.
    Raises :class:`CompressionError` on any problem. The result may alias a writable payload.

    Copies: a ``none`` payload decodes zero-copy when it is *writable* (``bytearray`` or a
    memoryview of one); a read-only ``bytes`` payload is copied once, because torch has no
    read-only tensors. Lossy codecs copy by nature.

    Copies: a ``none`` payload decodes zero-copy when it is *writable* (``bytearray`` or a
    memoryview of one); a read-only ``bytes`` payload is copied once, because torch has no
    read-only tensors. Lossy codecs copy by nature.
    """
    # built by from_wire: already validated (the flag cannot survive a change: frozen)
    checked = (
        compressed if compressed._checked else CompressedTensor.from_wire(*compressed.to_wire())
    )
    codec = LEAF_CODECS[checked.codec]
    dtype = _DTYPES[checked.dtype]
    flat = codec._decode(checked, dtype)  # [numel]
    out = flat.reshape(checked.shape)
    return require_finite(out, checked.codec) if check_finite else out
