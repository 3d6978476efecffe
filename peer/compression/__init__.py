"""Tensor codecs for averaging and state transfer (protocol logic, no I/O).

Names and meanings follow ``hivemind.compression``: :class:`NoCompression`, casts to 16 bits
(:class:`Float16Compression`, :class:`ScaledFloat16Compression`,
:class:`BFloat16Compression`) and 8- or 4-bit quantizations; :func:`compression_from_name`
gives one by a short name (its docstring has the table of codecs and their sizes). Wrappers
pick one of those per tensor from its :class:`CompressionInfo`:
:class:`SizeAdaptiveCompression`, :class:`PerTensorCompression`,
:class:`RoleAdaptiveCompression`. A codec turns a tensor into a :class:`CompressedTensor`
(its docstring has the wire format and what is validated); :func:`extract` decodes one.

The package: ``base`` (what every codec shares, the registry by wire name, :func:`extract`),
``casts`` and ``quantization`` (the leaf codecs), ``adaptive`` (the wrappers); this module
registers the leaf codecs and names them for a run's configuration.
"""

from __future__ import annotations

from peer.compression.adaptive import (
    PerTensorCompression,
    RoleAdaptiveCompression,
    SizeAdaptiveCompression,
)
from peer.compression.base import (
    LEAF_CODECS,
    CompressedTensor,
    Compression,
    CompressionError,
    CompressionInfo,
    TensorDescriptor,
    TensorRole,
    all_finite,
    byte_view,
    dtype_from_name,
    dtype_name,
    extract,
    plain_values,
    register_leaf,
)
from peer.compression.casts import (
    BFloat16Compression,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
)
from peer.compression.quantization import (
    Blockwise4BitQuantization,
    Blockwise8BitQuantization,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
)

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

for _codec in (
    NoCompression(),
    Float16Compression(),
    ScaledFloat16Compression(),
    BFloat16Compression(),
    Uniform8BitQuantization(),
    Quantile8BitQuantization(),
    Blockwise8BitQuantization(),
    Blockwise4BitQuantization(),
):
    register_leaf(_codec)
del _codec

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
    the choices otherwise.

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
    """
    if not isinstance(name, str):
        raise ValueError(f"a compression name must be a string, got {type(name).__name__}")
    key = _SHORT_NAMES.get(name.strip().lower(), name.strip().lower())
    if key not in LEAF_CODECS:
        choices = sorted({*_SHORT_NAMES, *LEAF_CODECS})
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(choices)}")
    return type(LEAF_CODECS[key])()
