"""The grouped expert kernels' K loops over 8- and 4-bit expert weights (moe_triton.py
`_up_kernel` and `_down_kernel` with ``QBITS`` 8 or 4), dequantized in registers.

The stored layouts are docs/quantization.md's, one stack per expert matrix:

- INT8: values int8 [E, out, in], a bf16 scale per expert and output row [E, out];
- INT4: values uint8 [E, out, in / 2] (column 2j in the low nibble, 2j + 1 in the high, each
  two's complement), a bf16 scale per expert, output row and group of ``GROUP`` input
  columns [E, out, in / GROUP].

Each weight is widened as the plain path dequantizes it (q * scale, exact in fp32, rounded
once to the scale's dtype, then to the activations'), so the products equal "dequantize,
then the 16-bit grouped product" up to the order of their fp32 sums. A K step of ``BK``
columns is two halves of ``BK / 2``: for INT4 the even and the odd columns (the low and the
high nibbles of the same bytes, read once, contiguous), for INT8 the first and the second half
of the step; each half is one ``tl.dot``.

Helpers only (no ``_ptr`` names: inlined into the launched kernels, never launched).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None


@dataclass(frozen=True)
class StoredExperts:
    """How a layer's expert stacks are stored, told by the values' dtypes (as docs/
    quantization.md's layout has it): ``qbits`` 0 (16-bit or FP8), 8 or 4; ``group``: INT4's
    input columns per scale (the kernels' ``GROUP``; 128 where unused); ``up_shape``: fc1's
    weight shape [E, 2I, D]."""

    qbits: int
    group: int
    up_shape: tuple[int, int, int]

    @classmethod
    def of(
        cls,
        w1: torch.Tensor,
        s1: torch.Tensor | None,
        w2: torch.Tensor,
        s2: torch.Tensor | None,
    ) -> StoredExperts:
        """The stacks' format; ValueError where the values, scales and shapes disagree."""
        bits = {torch.int8: 8, torch.uint8: 4}
        qbits = bits.get(w1.dtype, 0)
        if bits.get(w2.dtype, 0) != qbits:
            raise ValueError(f"expert weights in {w1.dtype} (fc1) and {w2.dtype} (fc2)")
        e, rows, cols = w1.shape
        if qbits == 0:
            return cls(0, 128, (e, rows, cols))
        if s1 is None or s2 is None:
            raise ValueError(f"{qbits}-bit expert weights need their scales")
        up = (e, rows, cols * 2 if qbits == 4 else cols)
        down = (w2.shape[0], w2.shape[1], w2.shape[2] * 2 if qbits == 4 else w2.shape[2])
        group = up[2] // s1.shape[-1] if qbits == 4 else 128
        for name, shape, scale in (("fc1", up, s1), ("fc2", down, s2)):
            want = shape[:2] if qbits == 8 else (*shape[:2], shape[2] // group)
            if tuple(scale.shape) != want or (qbits == 4 and shape[2] % group):
                raise ValueError(
                    f"{name}: scales {list(scale.shape)} do not fit {qbits}-bit weights "
                    f"{list(shape)} (expected {list(want)})"
                )
        return cls(qbits, group, up)


if triton is not None:

    @triton.jit
    def _widen(q, s, dtype: tl.constexpr):
        # One rounding to the scale's dtype (the dequantized weight's), then the activations'.
        return (q.to(tl.float32) * s.to(tl.float32)).to(s.dtype).to(dtype)

    @triton.jit
    def _columns(k0, QBITS: tl.constexpr, HALF: tl.constexpr):
        """The input columns of a K step's two halves."""
        js = tl.arange(0, HALF)
        if QBITS == 4:
            ka = k0 + 2 * js
            kb = ka + 1
        else:
            ka = k0 + js
            kb = ka + HALF
        return ka, kb

    @triton.jit
    def _x_halves(x_rows, x_ok, k0, k_hi, QBITS: tl.constexpr, HALF: tl.constexpr):
        """The activations of a K step's two halves, [BM, HALF] each (``x_rows`` [BM]: each
        row's first column)."""
        ka, kb = _columns(k0, QBITS, HALF)
        xa = tl.load(x_rows[:, None] + ka[None, :], mask=x_ok[:, None] & (ka < k_hi)[None, :],
                     other=0.0)  # fmt: skip
        xb = tl.load(x_rows[:, None] + kb[None, :], mask=x_ok[:, None] & (kb < k_hi)[None, :],
                     other=0.0)  # fmt: skip
        return xa, xb

    @triton.jit
    def _w_halves(w_rows, s_rows, s8, col_ok, k0, k_hi, dtype: tl.constexpr,
                  QBITS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
        """The widened weights of a K step's two halves, [HALF, BN] each (``w_rows``,
        ``s_rows`` [BN]: each output row's first stored value and scale; ``s8``: INT8's row
        scales [BN], loaded once)."""
        ka, kb = _columns(k0, QBITS, HALF)
        if QBITS == 4:
            ok = (ka < k_hi)[:, None] & col_ok[None, :]  # k_hi is even: kb < k_hi with ka
            js = tl.arange(0, HALF)
            packed = tl.load(w_rows[None, :] + (k0 // 2 + js)[:, None], mask=ok, other=0)
            packed = packed.to(tl.int32)
            s = tl.load(s_rows[None, :] + (ka // GROUP)[:, None], mask=ok, other=0.0)
            # Sign-extend each nibble: move it to the top of the word, shift back arithmetically.
            wa = _widen((packed << 28) >> 28, s, dtype)
            wb = _widen((packed << 24) >> 28, s, dtype)
        else:
            qa = tl.load(w_rows[None, :] + ka[:, None],
                         mask=(ka < k_hi)[:, None] & col_ok[None, :], other=0)  # fmt: skip
            qb = tl.load(w_rows[None, :] + kb[:, None],
                         mask=(kb < k_hi)[:, None] & col_ok[None, :], other=0)  # fmt: skip
            wa = _widen(qa, s8[None, :], dtype)
            wb = _widen(qb, s8[None, :], dtype)
        return wa, wb

    @triton.jit
    def _dot2(acc, xa, wa, xb, wb, IEEE: tl.constexpr):
        if IEEE:
            acc += tl.dot(xa, wa, input_precision="ieee")
            acc += tl.dot(xb, wb, input_precision="ieee")
        else:
            acc += tl.dot(xa, wa)
            acc += tl.dot(xb, wb)
        return acc

    @triton.jit
    def _row_scales(s_rows, col_ok, QBITS: tl.constexpr, BN: tl.constexpr):
        if QBITS == 8:
            return tl.load(s_rows, mask=col_ok, other=0.0)
        else:  # unused: INT4's scales vary along K
            return tl.zeros((BN,), dtype=tl.float32)

    @triton.jit
    def _rows(w, s, rows, k_len, QBITS: tl.constexpr, GROUP: tl.constexpr):
        """Pointers to output ``rows``' (int64 [BN]) first stored value and scale, for rows of
        ``k_len`` input columns."""
        if QBITS == 4:
            return w + rows * (k_len // 2), s + rows * (k_len // GROUP)
        else:
            return w + rows * k_len, s + rows

    @triton.jit
    def up_sums(acc_a, acc_b, x_rows, x_ok, w, s, e, cols, col_ok, dim, width, k_lo, k_hi,
                QBITS: tl.constexpr, GROUP: tl.constexpr, IEEE: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        """fc1's sums over K in [k_lo, k_hi) for both halves of expert ``e``'s columns
        ``cols`` (a: gelu's input, b: the gate), each K step's activations read once for
        both; ``x_rows`` [BM]: each row's first input."""
        HALF: tl.constexpr = BK // 2
        wa_rows, sa_rows = _rows(w, s, e * (2 * width) + cols, dim, QBITS, GROUP)
        wb_rows, sb_rows = _rows(w, s, e * (2 * width) + width + cols, dim, QBITS, GROUP)
        sa8 = _row_scales(sa_rows, col_ok, QBITS, BN)
        sb8 = _row_scales(sb_rows, col_ok, QBITS, BN)
        for k0 in range(k_lo, k_hi, BK):
            x0, x1 = _x_halves(x_rows, x_ok, k0, k_hi, QBITS, HALF)
            w0, w1 = _w_halves(wa_rows, sa_rows, sa8, col_ok, k0, k_hi, x0.dtype, QBITS, GROUP,
                               HALF)  # fmt: skip
            acc_a = _dot2(acc_a, x0, w0, x1, w1, IEEE)
            w0, w1 = _w_halves(wb_rows, sb_rows, sb8, col_ok, k0, k_hi, x0.dtype, QBITS, GROUP,
                               HALF)  # fmt: skip
            acc_b = _dot2(acc_b, x0, w0, x1, w1, IEEE)
        return acc_a, acc_b

    @triton.jit
    def down_sums(acc, h_rows, h_ok, w, s, e, cols, col_ok, dim, width, k_lo, k_hi,
                  QBITS: tl.constexpr, GROUP: tl.constexpr, IEEE: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        """fc2's sums over K in [k_lo, k_hi) of expert ``e``'s output columns ``cols``;
        ``h_rows`` [BM]: each row's first input."""
        HALF: tl.constexpr = BK // 2
        w_rows, s_rows = _rows(w, s, e * dim + cols, width, QBITS, GROUP)
        s8 = _row_scales(s_rows, col_ok, QBITS, BN)
        for k0 in range(k_lo, k_hi, BK):
            h0, h1 = _x_halves(h_rows, h_ok, k0, k_hi, QBITS, HALF)
            w0, w1 = _w_halves(w_rows, s_rows, s8, col_ok, k0, k_hi, h0.dtype, QBITS, GROUP,
                               HALF)  # fmt: skip
            acc = _dot2(acc, h0, w0, h1, w1, IEEE)
        return acc
