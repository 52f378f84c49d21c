"""The expert layer's routing and combine as Triton kernels (CUDA; the CPU tests interpret them).

`route_align` turns router logits [N, E] into what `moe.route` and `align` return
together: each token's top-k experts and their softmaxed weights, and the (token, expert) pairs
grouped by expert, padded to whole row blocks (pairs keep token order within an expert). One
launch for up to ``SINGLE_MAX_TOKENS`` tokens (decode); above, two: per program (at most
``MAX_PROGRAMS``, each over consecutive chunks of tokens) the top-k and its expert histogram,
then per program the placement of its pairs after the earlier programs' (a prefix over the
stored histograms: no atomics, so the layout is deterministic). Grids and buffers depend on
shapes only, never on the routing: CUDA graphs capture them, and no value is read back to the
host. `align_fused` does the grouping for given ids. `combine_fused` is `moe.combine_slots`
in one kernel, bit for bit (each product and sum rounded to the output dtype, slots in order,
no fused multiply-add).

Top-k ties go to the lower expert id. The softmax is exp(x - max) / sum in fp32 (CUDA's ``expf``
through libdevice, as PyTorch's kernel): the ids are `route`'s, the weights agree up to the
order of the k-term sum.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from vlm_server.models.common import launch_overlap

try:
    import triton
    import triton.language as tl

    from vlm_server.models.common.launch_overlap import gdc_launch_dependents, gdc_wait
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

# The interpreter (CPU tests) has no libdevice; numpy's exp is exactly rounded there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if triton is not None and not _INTERPRETED:
    from triton.language.extra import libdevice
else:
    libdevice = None

SINGLE_MAX_TOKENS = 16  # up to this many tokens one program routes and groups the whole step
CHUNK_PAIRS = 64  # pairs per one-hot tile [pairs, experts] (tokens per chunk: this / top-k)
FILL_BLOCKS = 64  # row blocks per step of the block-table pass
# Programs of the two-launch path: each placement program reads every program's histogram, so
# one chunk a program grew quadratically (84 us a layer at 5840 tokens: 730 programs).
MAX_PROGRAMS = 128
# Warps per routing program. Chunks, warps and the one-program bound by measurement (H100,
# route + grouping): 12.6 us at 730 tokens against 1102 for PyTorch's route and align.
ROUTE_WARPS = 8
COMBINE_COLS = 512


class Routing(NamedTuple):
    """The pairs grouped by expert: pair index per sorted row [blocks * block_m] (N * k marks a
    padding row), expert of each row block [blocks], rows in use [1]; all int32."""

    pair_ids: torch.Tensor
    block_expert: torch.Tensor
    used: torch.Tensor
    block_m: int


def n_row_blocks(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Row blocks of the worst case, the smaller of two bounds: every expert's group one row
    short of a block; and each of at most min(E, pairs) groups one block, plus a block per
    ``block_m`` of the pairs beyond the first of each (sum of ceil(c / M) <= groups +
    (pairs - groups) // M). The second holds a decode step's grid to the blocks it can use:
    8 instead of 61 for one token of top-8 routing over 64 experts in blocks of 16."""
    spread = -(-(n_pairs + n_experts * (block_m - 1)) // block_m)
    return min(spread, min(n_experts, n_pairs) + n_pairs // block_m)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


if triton is not None:
    # Reductions and scans with the standard library's combine functions, not tl.sum & co.:
    # the CPU tests' interpreted copy can call neither those (jitted where Triton was imported)
    # nor, at any speed, a combine of its own (element by element); these it runs in NumPy.
    _SUM = tl.standard._sum_combine
    _MAX = tl.standard._elementwise_max
    _MIN = tl.standard._elementwise_min

    @triton.jit
    def _rounded(x, dt: tl.constexpr):
        """fp32 ``x`` in ``dt``, rounded to nearest even. For bf16 in integer steps, as PyTorch
        rounds (the interpreter's own conversion truncates; on the GPU this costs a few
        integer ops in memory-bound kernels). NaNs are not preserved."""
        if dt == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dt)

    @triton.jit
    def _top_k(logits, tok, t_ok, n_experts, top_k, BT: tl.constexpr, KP: tl.constexpr,
               BE: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
        """[BT] tokens' logits -> (expert ids [BT, KP], fp32 weights [BT, KP]); slots >= k
        unused."""
        c = tl.arange(0, BE)
        v = tl.load(
            logits + tok[:, None].to(tl.int64) * n_experts + c[None, :],
            mask=t_ok[:, None] & (c < n_experts)[None, :],
            other=float("-inf"),
        ).to(tl.float32)
        slot = tl.arange(0, KP)
        top = tl.full([BT, KP], float("-inf"), tl.float32)
        ids = tl.full([BT, KP], 0, tl.int32)
        for j in range(0, top_k):
            m = tl.reduce(v, 1, _MAX)
            # the lowest id among equal maxima; clamped so a NaN row still names an expert
            idx = tl.reduce(tl.where(v == m[:, None], c[None, :], BE), 1, _MIN)
            idx = tl.minimum(idx, n_experts - 1)
            top = tl.where(slot[None, :] == j, m[:, None], top)
            ids = tl.where(slot[None, :] == j, idx[:, None], ids)
            v = tl.where(c[None, :] == idx[:, None], float("-inf"), v)
        z = top - tl.reduce(top, 1, _MAX)[:, None]
        if PRECISE:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
            ex = libdevice.exp(z)
        else:
            ex = tl.exp(z)
        ex = tl.where((slot < top_k)[None, :], ex, 0.0)
        return ids, ex / tl.reduce(ex, 1, _SUM)[:, None]

    @triton.jit
    def _layout(counts, BM: tl.constexpr):
        """Pairs per expert [BE] -> (first row, end row) of each expert's padded group, and
        the rows in use."""
        padded = (counts + BM - 1) // BM * BM
        ends = tl.associative_scan(padded, 0, _SUM)
        return ends - padded, ends, tl.reduce(padded, 0, _SUM)

    @triton.jit
    def _place(ids, ok, pair, base, pair_out, BP: tl.constexpr, BE: tl.constexpr):
        """Write each valid pair's index at its sorted row: ``base`` [BE] (where this chunk's
        pairs of each expert start) plus its rank among the chunk's pairs of that expert.
        Returns the chunk's pairs per expert."""
        e = tl.reshape(ids, [BP])
        valid = tl.reshape(ok.to(tl.int32), [BP]) != 0
        c = tl.arange(0, BE)
        hit = ((e[:, None] == c[None, :]) & valid[:, None]).to(tl.int32)
        rank = tl.associative_scan(hit, 0, _SUM) - hit  # earlier pairs of the same expert
        pos = tl.reduce(tl.where(hit != 0, rank + base[None, :], 0), 1, _SUM)
        tl.store(pair_out + pos, tl.reshape(pair, [BP]), mask=valid)
        return tl.reduce(hit, 0, _SUM)

    @triton.jit
    def _count(ids, ok, BP: tl.constexpr, BE: tl.constexpr):
        e = tl.reshape(ids, [BP])
        valid = tl.reshape(ok.to(tl.int32), [BP]) != 0
        hit = (e[:, None] == tl.arange(0, BE)[None, :]) & valid[:, None]
        return tl.reduce(hit.to(tl.int32), 0, _SUM)

    @triton.jit
    def _fill(block_out, ends, n_experts, blk0, blk1, BM: tl.constexpr, BE: tl.constexpr,
              RB: tl.constexpr):  # fmt: skip
        """The expert of each row block in [blk0, blk1): how many groups end at or before its
        first row (the padding rows are marked before the launch)."""
        for b0 in range(blk0, blk1, RB):
            b = b0 + tl.arange(0, RB)
            ex = tl.reduce((ends[None, :] <= (b * BM)[:, None]).to(tl.int32), 1, _SUM)
            tl.store(block_out + b, tl.minimum(ex, n_experts - 1), mask=b < blk1)

    @triton.jit
    def _route_kernel(
        logits_ptr, ids_ptr, weights_ptr, counts_ptr, pair_ptr, block_expert_ptr, used_ptr,
        n_tokens, n_experts, top_k, n_rows, chunks,
        FROM_LOGITS: tl.constexpr, ALIGN: tl.constexpr, PRECISE: tl.constexpr,
        BT: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr,
        RB: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        """``chunks`` chunks of BT tokens per program: top-k and weights (FROM_LOGITS) or the
        given ids, and their expert histogram; with ALIGN (one program: the whole step) the
        grouping too, else the histogram is stored for `_align_kernel`."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        slot = tl.arange(0, KP)
        counts = tl.full([BE], 0, tl.int32)
        for ch in range(0, chunks):
            tok = (pid * chunks + ch) * BT + tl.arange(0, BT)
            ok = (tok < n_tokens)[:, None] & (slot < top_k)[None, :]
            at = tok[:, None] * top_k + slot[None, :]
            if FROM_LOGITS:
                ids, w = _top_k(logits_ptr, tok, tok < n_tokens, n_experts, top_k, BT, KP, BE,
                                PRECISE)  # fmt: skip
                tl.store(ids_ptr + at, ids.to(ids_ptr.dtype.element_ty), mask=ok)
                tl.store(weights_ptr + at, _rounded(w, weights_ptr.dtype.element_ty), mask=ok)
            else:
                ids = tl.load(ids_ptr + at, mask=ok, other=0).to(tl.int32)
            counts += _count(ids, ok, BT * KP, BE)
        if ALIGN:
            tl.debug_barrier()  # this program's id stores are read back below
            starts, ends, used = _layout(counts, BM)
            seen = tl.full([BE], 0, tl.int32)
            for ch in range(0, chunks):
                tok = ch * BT + tl.arange(0, BT)
                ok = (tok < n_tokens)[:, None] & (slot < top_k)[None, :]
                at = tok[:, None] * top_k + slot[None, :]
                ids = tl.load(ids_ptr + at, mask=ok, other=0).to(tl.int32)
                seen += _place(ids, ok, at, starts + seen, pair_ptr, BT * KP, BE)
            _fill(block_expert_ptr, ends, n_experts, 0, n_rows // BM, BM, BE, RB)
            tl.store(used_ptr, used)
        else:
            tl.store(counts_ptr + pid * BE + tl.arange(0, BE), counts)

    @triton.jit
    def _align_kernel(
        ids_ptr, counts_ptr, pair_ptr, block_expert_ptr, used_ptr,
        n_tokens, n_experts, top_k, n_rows, blocks_per_program, chunks,
        BT: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr,
        RB: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        """Per program's ``chunks`` chunks of BT tokens: their pairs placed after the earlier
        programs' (a prefix over the stored histograms, in program order), and a share of the
        padding rows."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        c = tl.arange(0, BE)
        total = tl.full([BE], 0, tl.int32)
        before = tl.full([BE], 0, tl.int32)
        for b in range(0, tl.num_programs(0)):
            cnt = tl.load(counts_ptr + b * BE + c)
            total += cnt
            before += tl.where(b < pid, cnt, 0)
        starts, ends, used = _layout(total, BM)
        slot = tl.arange(0, KP)
        for ch in range(0, chunks):
            tok = (pid * chunks + ch) * BT + tl.arange(0, BT)
            ok = (tok < n_tokens)[:, None] & (slot < top_k)[None, :]
            at = tok[:, None] * top_k + slot[None, :]
            ids = tl.load(ids_ptr + at, mask=ok, other=0).to(tl.int32)
            before += _place(ids, ok, at, starts + before, pair_ptr, BT * KP, BE)
        blk0 = pid * blocks_per_program
        _fill(block_expert_ptr, ends, n_experts, blk0,
              tl.minimum(blk0 + blocks_per_program, n_rows // BM), BM, BE, RB)  # fmt: skip
        if pid == 0:
            tl.store(used_ptr, used)

    @triton.jit
    def _combine_kernel(
        y_ptr, w_ptr, out_ptr, dim, top_k, BD: tl.constexpr, PDL: tl.constexpr = False
    ):
        """out[n] = y[n, 0] w0 + y[n, 1] w1 + ...: each product and each sum rounded to the
        output dtype, in slot order (launched without FMA contraction)."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        ok = cols < dim
        acc = combined(y_ptr, w_ptr, n, cols, ok, dim, top_k, out_ptr.dtype.element_ty)
        tl.store(out_ptr + n * dim + cols, acc, mask=ok)

    @triton.jit
    def combined(y, w, n, cols, ok, dim, top_k, dt: tl.constexpr):
        """Token ``n``'s columns ``cols`` of sum_j y[n, j] w[n, j] (y [N, k, dim], w [N, k]),
        each product and each sum rounded to ``dt``, in slot order (a helper of the combine
        kernels, which launch without FMA contraction)."""
        rows = y + n * top_k * dim
        wj = tl.load(w + n * top_k).to(tl.float32)
        acc = _rounded(tl.load(rows + cols, mask=ok, other=0.0).to(tl.float32) * wj, dt)
        for j in range(1, top_k):
            wj = tl.load(w + n * top_k + j).to(tl.float32)
            p = _rounded(tl.load(rows + j * dim + cols, mask=ok, other=0.0).to(tl.float32) * wj, dt)
            acc = _rounded(acc.to(tl.float32) + p.to(tl.float32), dt)
        return acc


def _group(
    logits: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor | None,
    n_experts: int, block_m: int,
) -> Routing:  # fmt: skip
    """Launch the routing kernels: fill ``ids`` and ``weights`` from ``logits`` when given,
    and group the pairs."""
    if triton is None:
        raise RuntimeError("the routing kernels need Triton")
    n, k = ids.shape
    dev = ids.device
    kp, be = _pow2(k), _pow2(n_experts)
    # A chunk no larger than the step: one token's routing works on k pairs, not CHUNK_PAIRS.
    bt = max(1, min(CHUNK_PAIRS // kp, _pow2(n)))
    n_rows = n_row_blocks(n * k, n_experts, block_m) * block_m
    # Every row starts as padding (the pair count marks it); the kernels write the pairs'.
    pair_ids = torch.full((n_rows,), n * k, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_rows // block_m, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    src = ids if logits is None else logits
    w = ids if weights is None else weights  # not written without logits
    single = n <= max(SINGLE_MAX_TOKENS, bt)
    chunks = max(1, -(-n // bt))
    per_program = chunks if single else -(-chunks // MAX_PROGRAMS)
    programs = -(-chunks // per_program)
    counts = used if single else torch.empty((programs, be), dtype=torch.int32, device=dev)
    consts = {"BT": bt, "KP": kp, "BE": be, "BM": block_m, "RB": FILL_BLOCKS}
    consts["num_warps"] = ROUTE_WARPS
    _route_kernel[(programs,)](
        src, ids, w, counts, pair_ids, block_expert, used, n, n_experts, k, n_rows,
        per_program, FROM_LOGITS=logits is not None, ALIGN=single,
        PRECISE=libdevice is not None, **consts, **launch_overlap.kernel_args(),
    )  # fmt: skip
    if not single:
        per = -(-(n_rows // block_m) // programs)
        _align_kernel[(programs,)](
            ids, counts, pair_ids, block_expert, used, n, n_experts, k, n_rows, per,
            per_program, **consts, **launch_overlap.kernel_args(),
        )  # fmt: skip
    return Routing(pair_ids, block_expert, used, block_m)


def align(
    ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouping in PyTorch (`align_fused`'s reference): expert ids [N, k] -> (pair index
    per sorted row [blocks * block_m], with N * k marking a padding row; expert of each row
    block [blocks]; rows in use [1]), all int32 on ids' device."""
    flat = ids.reshape(-1)
    n_pairs = flat.numel()
    dev = flat.device
    # One-hot counts and ranks rather than a sort or bincount: plain scatters and a cumsum,
    # which never read a value back to the host (a graph may capture them).
    onehot = torch.zeros((n_pairs, n_experts), dtype=torch.int32, device=dev)
    onehot.scatter_(1, flat[:, None], 1)
    rank = onehot.cumsum(0, dtype=torch.int32).gather(1, flat[:, None])[:, 0] - 1
    counts = onehot.sum(0, dtype=torch.int64)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    pos = starts[flat] + rank  # pairs keep their order within an expert's group
    n_blocks = n_row_blocks(n_pairs, n_experts, block_m)
    pair_ids = torch.full((n_blocks * block_m,), n_pairs, dtype=torch.int32, device=dev)
    pair_ids[pos] = torch.arange(n_pairs, dtype=torch.int32, device=dev)
    block_starts = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=n_experts - 1)
    return pair_ids, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


def route_align(
    logits: torch.Tensor, top_k: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k] int64,
    the pairs grouped by expert in blocks of ``block_m`` rows): `moe.route` then `align`."""
    logits = logits.contiguous()
    n, n_experts = logits.shape
    ids = torch.empty((n, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((n, top_k), dtype=logits.dtype, device=logits.device)
    return weights, ids, _group(logits, ids, weights, n_experts, block_m)


def align_fused(ids: torch.Tensor, n_experts: int, block_m: int) -> Routing:
    """`align` in Triton: expert ids [N, k] -> the pairs grouped by expert."""
    return _group(None, ids.contiguous(), None, n_experts, block_m)


def combine_fused(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`moe.combine_slots` in one kernel: y [N, k, D], weights [N, k] -> [N, D], bit for bit."""
    if triton is None:
        raise RuntimeError("the combine kernel needs Triton")
    n, k, d = y.shape
    y, weights = y.contiguous(), weights.contiguous()
    out = torch.empty((n, d), dtype=torch.result_type(y, weights), device=y.device)
    if n:
        grid = (n, -(-d // COMBINE_COLS))
        # no FMA: PyTorch rounds each product before the sum
        _combine_kernel[grid](
            y, weights, out, d, k, BD=COMBINE_COLS, enable_fp_fusion=False,
            **launch_overlap.kernel_args(),
        )  # fmt: skip
    return out
