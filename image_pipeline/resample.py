"""Run resampling plans in torch, bit-exact, on the CPU or a GPU.

Every stage is a product of an integer weight matrix with integer pixels. In float32 such
a product is exact as long as every partial sum stays below 2**24, whatever order the
matmul adds in, so the stages run as ordinary (cuBLAS / CPU BLAS) matmuls. Weights too
wide for that (Pillow's 22-bit ones) are split into digits, one matmul per digit, and
recombined in float64. Where TF32 may be used for float32 matmuls, digits are kept to the
11 significant bits TF32 keeps.

On a GPU a stage whose float32 product is exact in one digit runs on the tensor cores
instead ("half products"): its weights as 11-bit digits in float16, its inputs in float16
(exact while they stay within 2048), each digit's product accumulated in float32 and the
digits combined by Horner's rule in the matmul's epilogue (``beta = 2**bits``). Every partial
sum is an integer below 2**24, so the result is the same integers.

The weight matrices are banded. Output indices are processed in blocks, each multiplying
only the input span its band touches: on the CPU small blocks save most of the work; on
a GPU one or a few large blocks save launches.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .resample_plan import ROWS, BoxShrink, Filter, Plan

__all__ = ["Resampler", "matmul_is_exact_fp32"]

_EXACT = 1 << 24  # float32 holds every integer up to this
_TF32_BITS = 11  # significant bits of a TF32 operand (and of a float16 one)
_HALF_EXACT = 1 << 11  # float16 holds every integer up to this
_CONVERT_WHOLE = 1 << 25  # uint8 inputs up to this many values are converted in one go
_LARGE_STAGE = 4_000_000  # input values from which a GPU stage runs in small blocks
# Half products by default on CUDA devices (False: float32 products there too, the image
# bench's "before").
HALF_PRODUCTS = True


def matmul_is_exact_fp32(device: torch.device) -> bool:
    """Whether float32 matmuls on ``device`` keep full float32 operands (no TF32/bf16)."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    if device.type != "cuda":
        return True
    # Both the legacy flag and the newer per-backend precision setting, where present.
    newer = getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
    if newer == "none":  # inherits the global setting
        newer = getattr(torch.backends, "fp32_precision", "ieee")
    return not torch.backends.cuda.matmul.allow_tf32 and newer in ("ieee", "none")


@dataclass(frozen=True)
class _Block:
    out_start: int
    out_stop: int
    in_start: int
    in_stop: int
    digits: tuple[torch.Tensor, ...]  # float32 [out, in]


@dataclass(frozen=True)
class _Prepared:
    blocks: tuple[_Block, ...]
    base: float  # digit k is worth base**k
    half: bool = False  # float16 digits, combined in float32 by Horner's rule

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for b in self.blocks for d in b.digits)


def _split_digits(weights: np.ndarray, bits: int, count: int | None = None) -> list[np.ndarray]:
    """Digits in base 2**bits, ``weights == sum(d * 2**(bits*k))``, the top one signed.

    As few as needed, or exactly ``count`` (the last one takes the rest).
    """
    digits = []
    rest = weights.copy()
    base = 1 << bits
    while True:
        last = len(digits) + 1 == count if count is not None else np.all(np.abs(rest) < base)
        if last:
            digits.append(rest)
            return digits
        low = np.mod(rest, base)
        digits.append(low)
        rest = (rest - low) // base


def _choose_digits(weights: np.ndarray, in_bound: int, shift: int, tf32: bool) -> tuple[int, list]:
    """Fewest digits whose partial sums stay exact; returns (bits, digits)."""
    top = int(np.abs(weights).max()) if weights.size else 0
    width = max(top.bit_length(), 1)
    for count in range(1, width + 1):
        bits = -(-width // count)
        if tf32 and bits > _TF32_BITS:
            continue
        digits = _split_digits(weights, bits)
        half = (1 << (shift - 1)) if len(digits) == 1 else 0
        if all(int(np.abs(d).sum(axis=1).max()) * in_bound + half < _EXACT for d in digits):
            return bits, digits
    raise ValueError("resampling weights cannot be applied exactly in float32")


def _half_digits(weights: np.ndarray, in_bound: int, shift: int) -> tuple[int, list] | None:
    """11-bit digits for half products, or None where they would not be exact: inputs past
    float16's integers, or a float32 product that needs more than one digit (Horner's partial
    sums are then no longer bounded by the one-digit sum)."""
    if in_bound > _HALF_EXACT:
        return None
    try:
        _, single = _choose_digits(weights, in_bound, shift, tf32=False)
    except ValueError:
        return None
    if len(single) != 1:
        return None
    return _choose_digits(weights, in_bound, shift, tf32=True)


def _horner(
    digits: tuple[torch.Tensor, ...], src: torch.Tensor, base: float, rows: torch.Tensor
) -> None:
    """``rows = sum_k digits[k] @ src * base**k`` in float32, by Horner's rule from the top
    digit (float16 operands; exact under `_half_digits`' bounds)."""
    src = src.to(torch.float16)
    top = len(digits) - 1
    if rows.is_cuda:
        torch.mm(digits[top], src, out_dtype=torch.float32, out=rows)
        for d in reversed(digits[:top]):
            torch.addmm(rows, d, src, out_dtype=torch.float32, beta=base, out=rows)
        return
    # float16 products with float32 results are CUDA's: the same integers in float32 here
    src32 = src.float()
    torch.matmul(digits[top].float(), src32, out=rows)
    for d in reversed(digits[:top]):
        rows.mul_(base).add_(torch.matmul(d.float(), src32))


class Resampler:
    """Applies :class:`Plan` objects to ``[H, W, C]`` pixel tensors on one device.

    Thread-safe: prepared weights are cached per stage and device behind a lock; the
    computation itself shares nothing. ``half``: half products where exact (default: on a
    CUDA device, `HALF_PRODUCTS`); on the CPU they are emulated in float32 (the tests).
    """

    CACHE_BYTES = 128 << 20  # prepared weights kept (least recently used go first)

    def __init__(
        self,
        device: torch.device | str,
        block: int | None = None,
        large_block: int | None = None,
        half: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.half = HALF_PRODUCTS and self.device.type == "cuda" if half is None else half
        # Output indices per matmul block: small on the CPU (less work), large on a GPU,
        # where the image path is launch-bound: one block per stage up to 2048 outputs
        # (canvases of common sizes), and the extra multiply-adds cost little there.
        self.block = block if block is not None else (32 if self.device.type == "cpu" else 2048)
        # Blocks of stages that read 4M values or more, where the launches are hidden (see
        # `_block_for`); None: ``block`` everywhere.
        self.large_block = large_block
        self._cache: collections.OrderedDict[
            tuple[int, int, bool, int, bool], tuple[Filter, _Prepared]
        ]
        self._cache = collections.OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def run(self, pixels: torch.Tensor, plan: Plan, keep: list | None = None) -> torch.Tensor:
        """``pixels`` uint8 ``[H, W, C]`` -> uint8 ``[H', W', C]``. ``keep`` collects the
        prepared weights used: a CUDA graph captured here reads them at every replay, after
        the cache may have evicted them."""
        if tuple(pixels.shape[:2]) != plan.in_size:
            raise ValueError(f"plan is for {plan.in_size}, pixels are {tuple(pixels.shape[:2])}")
        # Every stage works along dim 0, so each block is one 2-D matmul over whole rows
        # writing a contiguous slice of the output; the image is transposed between axes.
        x = pixels.to(self.device)
        along = ROWS
        tf32 = not matmul_is_exact_fp32(self.device)
        bound = 255
        for stage in plan.stages:
            if stage.axis != along:
                x = x.transpose(0, 1).contiguous()
                along = stage.axis
            if isinstance(stage, BoxShrink):
                x = self._box(x, stage).to(torch.uint8)
            else:
                x = self._filter(x, stage, bound, tf32, keep)
                bound = stage.out_bound(bound)
                # Between stages the values are small integers: keep them in the
                # narrowest exact type (less to transpose and to move).
                x = x.to(torch.uint8 if stage.clip else torch.int16)
        if along != ROWS:
            x = x.transpose(0, 1).contiguous()
        return x

    # ------------------------------------------------------------------ stages

    @staticmethod
    def _box(x: torch.Tensor, stage: BoxShrink) -> torch.Tensor:
        n, out_len = stage.factor, stage.out_len
        pad = out_len * n - x.shape[0]
        if pad:  # repeat the edge, as libvips' embed does
            x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
        sums = x.reshape(out_len, n, *x.shape[1:]).sum(1, dtype=torch.float64)
        return torch.floor((sums + n // 2) * stage.multiplier / (1 << 24)).to(torch.float32)

    def _filter(
        self, x: torch.Tensor, stage: Filter, bound: int, tf32: bool, keep: list | None
    ) -> torch.Tensor:
        prepared = self._prepare(stage, bound, tf32, self._block_for(x.numel()))
        if keep is not None:
            keep.append(prepared)
        rest = x.shape[1:]
        flat = x.reshape(x.shape[0], -1)
        operand = torch.float16 if prepared.half else torch.float32
        if flat.dtype != operand and flat.numel() <= _CONVERT_WHOLE:
            flat = flat.to(operand)  # once, rather than per (overlapping) block
        rounding = 1 << (stage.shift - 1)
        scale = 1.0 / (1 << stage.shift)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None and torch.cuda.is_current_stream_capturing():
            stream = None  # a graph keeps its weights itself (``keep``)
        single = len(prepared.blocks[0].digits) == 1
        dtype = torch.float32 if single or prepared.half else torch.float64
        out = torch.empty((stage.out_len, flat.shape[1]), dtype=dtype, device=flat.device)
        for block in prepared.blocks:
            if stream is not None:
                # Cached weights are shared by the decode threads' streams: an evicted
                # block must not be reused while this stream may still read it.
                for d in block.digits:
                    d.record_stream(stream)
            rows = out[block.out_start : block.out_stop]
            if prepared.half:
                _horner(block.digits, flat[block.in_start : block.in_stop], prepared.base, rows)
                continue
            src = flat[block.in_start : block.in_stop].to(torch.float32)
            if single:
                torch.matmul(block.digits[0], src, out=rows)
            else:
                rows.zero_()
                for k, d in enumerate(block.digits):
                    rows.add_(torch.matmul(d, src).to(torch.float64), alpha=prepared.base**k)
        out = torch.floor_(out.add_(rounding).mul_(scale))
        if stage.clip:
            out.clamp_(0, 255)
        return out.to(torch.float32).reshape(stage.out_len, *rest)

    def _block_for(self, values: int) -> int:
        """Output indices per block for a stage reading ``values`` input values.

        Where the launches are queued well ahead of the device (behind a GPU decode, which
        keeps the stream busy for milliseconds), a large stage's cost is its multiply-adds,
        and small blocks skip most of them: on an H100 a 12 MP picture decoded by the JPEG
        engines was resized and cropped in 2.49 ms with blocks of 256 against 3.16 with one
        block. Where the host launches as the device runs, more blocks cost more than they
        save (a host-decoded 1920x1080: 1.46 ms with one block, 2.07 with blocks of 256)."""
        if self.large_block is not None and values >= _LARGE_STAGE:
            return self.large_block
        return self.block

    def _prepare(self, stage: Filter, bound: int, tf32: bool, block: int) -> _Prepared:
        key = (id(stage), bound, tf32, block, self.half)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is not None and hit[0] is stage:
            return hit[1]
        half = _half_digits(stage.band, bound, stage.shift) if self.half else None
        bits, stage_digits = half or _choose_digits(stage.band, bound, stage.shift, tf32)
        dtype = torch.float32 if half is None else torch.float16
        blocks = []
        for start in range(0, stage.out_len, block):
            stop = min(start + block, stage.out_len)
            in_start = int(stage.starts[start:stop].min())
            in_stop = max(int(stage.stops[start:stop].max()), in_start + 1)
            dense = stage.dense(start, stop, in_start, in_stop)
            tensors = []
            for d in _split_digits(dense, bits, len(stage_digits)):
                part = torch.from_numpy(d.astype(np.float32)).to(dtype)
                tensors.append(part.to(self.device))
            blocks.append(_Block(start, stop, in_start, in_stop, tuple(tensors)))
        prepared = _Prepared(tuple(blocks), float(1 << bits), half is not None)
        with self._lock:
            # Keeping the stage in the entry pins its id; plans are cached, so few stay.
            old = self._cache.pop(key, None)
            if old is not None:
                self._cached_bytes -= old[1].nbytes
            self._cache[key] = (stage, prepared)
            self._cached_bytes += prepared.nbytes
            while self._cached_bytes > self.CACHE_BYTES and len(self._cache) > 1:
                _, (_, evicted) = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.nbytes
        return prepared
