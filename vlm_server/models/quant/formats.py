"""The weight-only formats (docs/quantization.md): per-channel INT8 and group-wise INT4,
symmetric, with bf16 scales; activations stay 16-bit.

A weight is ``[..., out, in]``: a linear layer's ``[out, in]`` or a stack of experts'
``[E, out, in]``; leading dimensions are kept as they are in the values and the scales.

* INT8: ``qweight`` int8 ``[..., out, in]``, ``scale`` bf16 ``[..., out]``,
  ``w ~ qweight * scale[..., None]``, ``scale = max|row| / 127``.
* INT4: groups of ``group_size`` consecutive input columns per row, ``scale = max|group| / 7``,
  ``q = clamp(round(w / scale), -8, 7)``; ``qweight`` uint8 ``[..., out, in / 2]`` (the even
  column in the low nibble, the odd one in the high, each ``q & 0xF``), ``scale`` bf16
  ``[..., out, in / group_size]``.

An all-zero row (or group) gets scale 1 and values 0, so no scale is ever zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.bfloat16
GROUP_SIZE = 128  # the kernels' group
# Group sizes a file may declare (smaller ones serve small test models; the kernels take 128).
GROUP_SIZES = (32, 64, 128)
INT8_MAX = 127
INT4_MAX, INT4_MIN = 7, -8


class QuantError(ValueError):
    """A tensor cannot take, or a file does not hold, a quantized format."""


@dataclass(frozen=True)
class QuantFormat:
    """A weight format: its name (``--weights``), value bits, the input columns one scale
    covers (0: the whole row) and the dtype of its scales."""

    name: str
    bits: int
    group_size: int

    def bytes_per_param(self, in_features: int) -> float:
        """Bytes per weight, the scales included, for rows of ``in_features`` columns."""
        per_row = 1 if self.group_size == 0 else in_features // self.group_size
        return self.bits / 8 + per_row * SCALE_DTYPE.itemsize / in_features

    def scale_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale shape this format gives a weight of ``shape`` (named in errors)."""
        _check_matrix(name, shape)
        if self.group_size == 0:
            return shape[:-1]
        _check_groups(name, shape, self.group_size)
        return (*shape[:-1], shape[-1] // self.group_size)

    def qweight_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored values' shape for a weight of ``shape``."""
        _check_matrix(name, shape)
        if self.bits == 8:
            return shape
        _check_groups(name, shape, self.group_size)
        return (*shape[:-1], shape[-1] // 2)

    def weight_shape(self, name: str, qshape: tuple[int, ...]) -> tuple[int, ...]:
        """The weight's shape from its stored values' shape."""
        _check_matrix(name, qshape)
        return qshape if self.bits == 8 else (*qshape[:-1], qshape[-1] * 2)

    def quantize(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight, scale) of ``w``; ``name`` is the tensor's, for errors."""
        if self.bits == 8:
            _check_matrix(name, tuple(w.shape))
            return quantize_int8(w)
        _check_groups(name, tuple(w.shape), self.group_size)
        return quantize_int4(w, self.group_size)

    def dequantize(
        self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        if self.bits == 8:
            return dequantize_int8(qweight, scale, dtype)
        return dequantize_int4(qweight, scale, self.group_size, dtype)


def weight_format(name: str, group_size: int = GROUP_SIZE) -> QuantFormat:
    """The format ``--weights`` names: ``int8`` (per channel) or ``int4`` (``group_size``)."""
    if name == "int8":
        return QuantFormat("int8", 8, 0)
    if name == "int4":
        if group_size not in GROUP_SIZES:
            raise QuantError(f"group_size: {group_size} is not one of {list(GROUP_SIZES)}")
        return QuantFormat("int4", 4, group_size)
    raise QuantError(f"weights: {name!r} is not a quantized format (int8 or int4)")


def _check_matrix(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) < 2:
        raise QuantError(f"{name}: shape {list(shape)} is not a weight matrix")


def _check_groups(name: str, shape: tuple[int, ...], group_size: int) -> None:
    _check_matrix(name, shape)
    if shape[-1] % group_size:
        raise QuantError(
            f"{name}: {shape[-1]} input columns (shape {list(shape)}) are not a multiple of "
            f"the INT4 group of {group_size}"
        )


def _scales(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """bf16 scales of the absolute maxima; a zero maximum gets 1. Rounded to bf16 before the
    values are computed, so the values are those the stored scale decodes."""
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return scale.to(SCALE_DTYPE)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., out, in]`` -> (int8 ``[..., out, in]``, bf16 scales ``[..., out]``)."""
    w32 = w.float()
    scale = _scales(w32.abs().amax(dim=-1), INT8_MAX)
    q = torch.round(w32 / scale.float()[..., None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_int8(
    qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return (qweight.float() * scale.float()[..., None]).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Values in [-8, 7] ``[..., in]`` (``in`` even) -> uint8 ``[..., in / 2]``: the even
    column in the low nibble, the odd one in the high, each in two's complement."""
    if q.shape[-1] % 2:
        raise QuantError(f"INT4 packing needs an even number of columns, not {q.shape[-1]}")
    nibbles = q.to(torch.int16) & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n]`` -> int8 values in [-8, 7] ``[..., 2n]`` (`pack_int4`'s inverse)."""
    p = packed.to(torch.int16)
    low, high = p & 0xF, (p >> 4) & 0xF
    both = torch.stack([low, high], dim=-1).flatten(-2)
    return torch.where(both > 7, both - 16, both).to(torch.int8)


def quantize_int4(
    w: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., out, in]`` -> (packed uint8 ``[..., out, in / 2]``, bf16 scales
    ``[..., out, in / group_size]``)."""
    _check_groups("weight", tuple(w.shape), group_size)
    groups = w.float().unflatten(-1, (w.shape[-1] // group_size, group_size))
    scale = _scales(groups.abs().amax(dim=-1), INT4_MAX)
    q = torch.round(groups / scale.float()[..., None]).clamp(INT4_MIN, INT4_MAX)
    return pack_int4(q.flatten(-2)), scale


def dequantize_int4(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    group_size: int = GROUP_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    q = unpack_int4(qweight).float()
    groups = q.unflatten(-1, (q.shape[-1] // group_size, group_size))
    return (groups * scale.float()[..., None]).flatten(-2).to(dtype)
