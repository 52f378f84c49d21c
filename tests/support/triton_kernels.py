"""Every Triton kernel of the project, as its launchers compile it: the argument types and
constants they pass (bf16 model tensors, fp32 partials, int32 tables), the warps they launch
with, and the oldest chip each runs on. tests/test_kernels_compile_gpu.py builds each for
every chip; tests/test_kernels_fit_chips.py checks each launch configuration fits it.

The FP8 kernels of the vision tower use e4m3, which chips before sm_89 lack (Triton refuses
the type there): they are built for sm_89 and later only, and ``--vision-fp8`` refuses older
chips at start.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from vlm_server.models.common import fp8_vision, fused_norm
from vlm_server.models.moondream3 import moe_routing

TARGETS = (80, 86, 89, 90, 100, 120)


@dataclass(frozen=True)
class Kernel:
    module: str
    name: str
    signature: dict[str, str]  # argument -> Triton type, constexprs left out
    constants: dict[str, Any]
    min_arch: int = 80
    extra: dict[str, Any] = field(default_factory=dict)
    warps: int = 4  # num_warps as the launcher passes it (Triton's default: 4)


_DECODE = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
    "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
    "table_ptr": "*i32", "rows_ptr": "*i32", "lengths_ptr": "*i32",
    "scale": "fp32", "table_stride": "i32", "rows_stride": "i32",
    "n_heads": "i32", "kv_group": "i32",
}  # fmt: skip
_TILE = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
    "out_ptr": "*bf16",
    "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
    "table_ptr": "*i32", "rows_ptr": "*i32", "pos_ptr": "*i32", "tiles_ptr": "*i32",
    "scale": "fp32", "table_stride": "i32", "rows_stride": "i32", "pos_stride": "i32",
    "n_heads": "i32", "kv_group": "i32",
}  # fmt: skip
_ROPE = {
    "qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32",
    "table_ptr": "*i32", "rows_ptr": "*i32", "q_out_ptr": "*bf16", "k_ptr": "*bf16",
    "v_ptr": "*bf16", "k_out_ptr": "*bf16", "v_out_ptr": "*bf16", "ks_ptr": "*fp32",
    "vs_ptr": "*fp32", "n_tokens": "i32", "qkv_stride": "i32",
    "pos_stride": "i32", "table_stride": "i32", "rows_stride": "i32", "n_heads": "i32",
}  # fmt: skip
_NORM = {
    "x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "w_ptr": "*bf16",
    "bias_ptr": "*bf16", "sum_ptr": "*bf16", "out_ptr": "*bf16", "dim": "i32", "eps": "fp32",
}  # fmt: skip
_COMBINE_NORM = {
    "x_ptr": "*bf16", "a_ptr": "*bf16", "y_ptr": "*bf16", "rw_ptr": "*bf16", "w_ptr": "*bf16",
    "bias_ptr": "*bf16", "sum_ptr": "*bf16", "out_ptr": "*bf16", "dim": "i32", "top_k": "i32",
    "eps": "fp32",
}  # fmt: skip
_NORM_FP8 = {
    "x_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16",
    "sum_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "row_ptr": "*fp32",
    "col_ptr": "*fp32", "a_bias_ptr": "*bf16", "dim": "i32", "eps": "fp32",
}  # fmt: skip
_GELU_FP8 = {
    "u_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "row_ptr": "*fp32",
    "col_ptr": "*fp32", "bias_ptr": "*bf16", "width": "i32", "width_out": "i32",
}  # fmt: skip
_LORA = "vlm_server.models.common.lora_kernel"
_SHRINK = {
    "x_ptr": "*bf16", "a_ptr": "*bf16", "idx_ptr": "*i32", "v_ptr": "*fp32", "K": "i32",
    "stride_xt": "i32", "stride_as": "i32", "stride_ar": "i32",
}  # fmt: skip
_EXPAND = {
    "v_ptr": "*fp32", "b_ptr": "*bf16", "idx_ptr": "*i32", "y_ptr": "*bf16", "N": "i32",
    "stride_bs": "i32", "stride_bn": "i32",
}  # fmt: skip
_GROUP_SHRINK = {
    "x_ptr": "*bf16", "a_ptr": "*bf16", "idx_ptr": "*i32", "v_ptr": "*fp32", "T": "i32",
    "K": "i32", "stride_xt": "i32", "stride_as": "i32", "stride_ar": "i32",
    "sum_ptr": "*fp32", "count_ptr": "*i32",
}  # fmt: skip
_GROUP_EXPAND = {
    "v1_ptr": "*fp32", "b1_ptr": "*bf16", "y1_ptr": "*bf16", "v2_ptr": "*fp32",
    "b2_ptr": "*bf16", "y2_ptr": "*bf16", "idx_ptr": "*i32", "T": "i32", "n_slots": "i32",
    "N1": "i32", "N2": "i32", "NB1": "i32", "col1": "i32", "col2": "i32", "splits1": "i32",
    "splits2": "i32", "stride_v1": "i32", "stride_v1s": "i32", "stride_v2": "i32",
    "stride_v2s": "i32", "stride_b1s": "i32", "stride_b1n": "i32", "stride_b2s": "i32",
    "stride_b2n": "i32", "stride_y1": "i32", "stride_y2": "i32", "slot_cols1": "i32",
    "slot_cols2": "i32", "a3_ptr": "*bf16", "v3_ptr": "*fp32", "stride_a3s": "i32",
    "stride_a3r": "i32", "stride_v3": "i32",
}  # fmt: skip
_GROUP_BLOCKS = {"BLOCK_T": 32, "PRECISION": "tf32"}
_STEP = "vlm_server.models.common.lora_step"
_STEP_EXPAND = {
    "v1_ptr": "*fp32", "b1_ptr": "*bf16", "y1_ptr": "*bf16", "v2_ptr": "*fp32",
    "b2_ptr": "*bf16", "y2_ptr": "*bf16", "idx_ptr": "*i32", "T": "i32", "n_slots": "i32",
    "N1": "i32", "N2": "i32", "NB1": "i32", "col1": "i32", "col2": "i32",
    "slot_cols1": "i32", "slot_cols2": "i32", "stride_v1": "i32", "stride_v2": "i32",
    "stride_b1s": "i32", "stride_b1n": "i32", "stride_b2s": "i32", "stride_b2n": "i32",
    "stride_y1": "i32", "stride_y2": "i32",
}  # fmt: skip
_MOE = "vlm_server.models.moondream3.moe_triton"
_MOE_ARGS = {
    "w_ptr": "*bf16", "s_ptr": "*fp32", "pair_ptr": "*i32", "block_expert_ptr": "*i32",
    "used_ptr": "*i32", "d_ptr": "*bf16", "n_pairs": "i32", "dim": "i32", "width": "i32",
    "part_ptr": "*fp32", "k_per_split": "i32",
}  # fmt: skip
_MOE_FP8 = {**_MOE_ARGS, "w_ptr": "*fp8e4nv"}
_MOE_UP = {"h_ptr": "*bf16", "top_k": "i32", "xs_ptr": "*fp32"}
_MOE_BLOCKS = {"IEEE": False, "SPLIT": 1, "BM": 16, "BN": 64, "BK": 64}
_MOE_FP8_ACT_BLOCKS = {"IEEE": False, "SPLIT": 1, "BM": 128, "BN": 128, "BK": 128}
_ACT_QUANT = "vlm_server.models.moondream3.act_quant"
_ACT_QUANT_ARGS = {
    "x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "pair_ptr": "*i32",
    "n_pairs": "i32", "cols": "i32", "min_scale": "fp32",
}  # fmt: skip
_MOE_ROUTING = "vlm_server.models.moondream3.moe_routing"
_ROUTE = {
    "logits_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*bf16", "counts_ptr": "*i32",
    "pair_ptr": "*i32", "block_expert_ptr": "*i32", "used_ptr": "*i32", "n_tokens": "i32",
    "n_experts": "i32", "top_k": "i32", "n_rows": "i32", "chunks": "i32",
    "blocks_per_program": "i32",
}  # fmt: skip
_ROUTE_BLOCKS = {"BT": 8, "KP": 8, "BE": 64, "BM": 16, "RB": 64}
_TAU = "vlm_server.models.moondream3.tau_kernel"
_TAU_SHAPE = {"H": 32, "KVH": 32, "HD": 64, "BM": 16}
_SKINNY = "vlm_server.models.common.skinny_gemm"
_SKINNY_ARGS = {
    "x1_ptr": "*bf16", "x2_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "b_ptr": "*bf16",
    "r_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32", "N": "i32",
    "K1": "i32", "K2": "i32", "k_per_split": "i32", "stride_x1": "i32", "stride_x2": "i32",
    "stride_w": "i32", "stride_s": "i32", "stride_s1": "i32",
    "stride_r": "i32", "stride_y": "i32", "gelu_from": "i32", "e_ptr": "*bf16",
    "ext_ptr": "*fp32", "NB": "i32", "NE": "i32", "RS": "i32", "e_koff": "i32",
    "ke_per_split": "i32", "stride_es": "i32", "stride_er": "i32",
}  # fmt: skip
_SPLIT_SUM = {
    "part_ptr": "*fp32", "b_ptr": "*bf16", "r_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32",
    "N": "i32", "stride_r": "i32", "stride_y": "i32", "gelu_from": "i32",
}  # fmt: skip
_SKINNY_FLAGS = {"HAS_BIAS": True, "HAS_RES": True, "HAS_GELU": True}
_QUANT = "vlm_server.models.common.quant_gemm"
_QUANT_ARGS = {
    "x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*bf16", "b_ptr": "*bf16", "r_ptr": "*bf16",
    "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_x": "i32",
    "stride_w": "i32", "stride_s": "i32", "stride_r": "i32", "stride_y": "i32",
    "gelu_from": "i32",
}  # fmt: skip
_QUANT_SKINNY = {**_QUANT_ARGS, "part_ptr": "*fp32", "k_per_split": "i32"}
_QUANT_FLAGS = {"HAS_BIAS": True, "HAS_RES": True, "HAS_GELU": True, "IEEE": False}
_ATTENTION = "vlm_server.engine.device.kernels.triton_attention"
_KV_STORE = "vlm_server.engine.device.kernels.triton_kv_store"
_SHAPE = {"PAGE": 16, "KVH": 32, "HD": 64}
# Compact KV pages (--kv-dtype): the pools' element type, QUANT, QMAX, the oldest chip.
_KV_COMPACT = (("*i8", 1, 127.0, 80), ("*fp8e4nv", 2, 448.0, 89))


def _compact_pools(args: dict[str, str], element: str) -> dict[str, str]:
    return {**args, "k_ptr": element, "v_ptr": element}


KERNELS = (
    Kernel(
        _SKINNY,
        "_skinny_kernel",
        _SKINNY_ARGS,
        {
            **_SKINNY_FLAGS,
            "IEEE": False,
            "SPLIT": True,
            "EXTRA": False,
            "BLOCK_M": 16,
            "BLOCK_N": 32,
            "BLOCK_K": 128,
        },
    ),
    Kernel(
        _SKINNY,
        "_skinny_kernel",
        _SKINNY_ARGS,
        {
            **_SKINNY_FLAGS,
            "IEEE": False,
            "SPLIT": False,
            "EXTRA": False,
            "BLOCK_M": 32,
            "BLOCK_N": 64,
            "BLOCK_K": 128,
        },
    ),
    # On the CUDA cores (SkinnyConfig.fma), as one row launches it: whole K and split.
    *(
        Kernel(
            _SKINNY,
            "_skinny_kernel",
            _SKINNY_ARGS,
            {
                **_SKINNY_FLAGS,
                **{"IEEE": False, "SPLIT": split, "EXTRA": False, "FMA": True},
                **{"BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 1024},
            },
        )
        for split in (False, True)
    ),
    # With a LoRA shrink's extra columns (models/lora/products.py), as moondream2's decode
    # launches them at 32 rows: QKV and fc1 whole-K, the branch split.
    *(
        Kernel(
            _SKINNY,
            "_skinny_kernel",
            _SKINNY_ARGS,
            {
                **_SKINNY_FLAGS,
                **{"HAS_RES": False, "HAS_GELU": False, "IEEE": False, "EXTRA": True},
                **{"SPLIT": split, "BLOCK_M": 32, "BLOCK_N": bn, "BLOCK_K": bk},
            },
        )
        for split, bn, bk in ((False, 128, 128), (True, 64, 256))
    ),
    # Over stacked INT8 and INT4 weights (models/common/quant_stack.py), as moondream2's fused
    # decode launches them: one row on the CUDA cores, 32 rows in tensor-core tiles, split.
    *(
        Kernel(
            _SKINNY,
            "_skinny_kernel",
            {**_SKINNY_ARGS, "w_ptr": "*u8" if qbits == 4 else "*i8"},
            {
                **_SKINNY_FLAGS,
                **{"IEEE": False, "SPLIT": True, "EXTRA": False, "FMA": fma, "QBITS": qbits},
                **tiles,
            },
        )
        for qbits in (8, 4)
        for fma, tiles in (
            (True, {"BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 1024}),
            (False, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 256}),
        )
    ),
    Kernel(
        _SKINNY,
        "_split_sum_kernel",
        _SPLIT_SUM,
        {**_SKINNY_FLAGS, "SPLITS": 4, "BLOCK_M": 16, "BLOCK_N": 128},
    ),
    # Over INT8 and INT4 weights (packed two a byte): decode on the CUDA cores and in
    # tensor-core tiles, split and whole, and the prefill tiles.
    *(
        Kernel(
            _QUANT,
            "_quant_skinny_kernel",
            {**_QUANT_SKINNY, "w_ptr": "*u8" if int4 else "*i8"},
            {**_QUANT_FLAGS, "INT4": int4, "SPLIT": split, "FMA": fma, **tiles},
        )
        for int4 in (False, True)
        for split, fma, tiles in (
            (True, True, {"BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 1024}),
            (False, False, {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128}),
            (True, False, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256}),
        )
    ),
    *(
        Kernel(
            _QUANT,
            "_quant_gemm_kernel",
            {**_QUANT_ARGS, "w_ptr": "*u8" if int4 else "*i8"},
            {**_QUANT_FLAGS, "INT4": int4, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64},
            warps=8,
        )
        for int4 in (False, True)
    ),
    Kernel(
        _QUANT,
        "_quant_split_sum_kernel",
        _SPLIT_SUM,
        {**_SKINNY_FLAGS, "SPLITS": 4, "BLOCK_M": 16, "BLOCK_N": 128},
    ),
    Kernel(_LORA, "_shrink_kernel", _SHRINK, {"R": 32, "BLOCK_R": 32, "BLOCK_K": 256, "SPLITS": 8}),
    Kernel(
        _LORA,
        "_expand_kernel",
        _EXPAND,
        {"R": 32, "BLOCK_R": 32, "BLOCK_N": 64, "ADD": True, "SPLITS": 8},
    ),
    # The grouped form: the stacked shrink of three rank-32 targets (qkv, proj, fc1) and fc2's
    # over K = 8192; the two-output expand with and without the GELU, and two deltas summed
    # into one output (here bf16; the fused decode adds into fp32 split sums too).
    Kernel(
        _LORA,
        "_group_shrink_kernel",
        _GROUP_SHRINK,
        {
            **_GROUP_BLOCKS,
            **{"R": 96, "BLOCK_R": 128, "BLOCK_K": 64, "ITERS": 2, "SPLITS": 16},
            "REDUCE": False,
        },
    ),
    *(
        Kernel(
            _LORA,
            "_group_shrink_kernel",
            _GROUP_SHRINK,
            {
                **_GROUP_BLOCKS,
                **{"R": 32, "BLOCK_R": 32, "BLOCK_K": 128, "ITERS": 4, "SPLITS": 16},
                "REDUCE": reduce,  # a decode step's: the splits summed in the launch
            },
        )
        for reduce in (False, True)
    ),
    *(
        Kernel(
            _LORA,
            "_group_expand_kernel",
            _GROUP_EXPAND,
            {
                **_GROUP_BLOCKS,
                **{"R": 32, "BLOCK_R": 32, "BLOCK_N": 128, "SPLITS": 16},
                **{"GELU": gelu, "SUM": total, "SHRINK": shrink, "ITERS2": 4 if shrink else 1},
            },
        )
        for gelu, total, shrink in (
            (True, False, False),
            (True, False, True),
            (False, False, False),
            (False, True, False),
        )
    ),
    # The decode step's expand over the slots: with the GELU, and two deltas summed into a
    # buffer of their own (fp32).
    Kernel(
        _STEP,
        "_step_expand_kernel",
        _STEP_EXPAND,
        {
            **_GROUP_BLOCKS,
            **{"R": 32, "BLOCK_R": 32, "BLOCK_N": 64, "GELU": True, "SUM": False, "ADD": True},
        },
    ),
    Kernel(
        _STEP,
        "_step_expand_kernel",
        {**_STEP_EXPAND, "y1_ptr": "*fp32", "y2_ptr": "*fp32"},
        {
            **_GROUP_BLOCKS,
            **{"R": 32, "BLOCK_R": 32, "BLOCK_N": 16, "GELU": False, "SUM": True, "ADD": False},
        },
    ),
    *(
        kernel
        for delta in (False, True)  # a finetune adapter's deltas in the epilogues
        for kernel in (
            Kernel(
                _MOE,
                "_up_kernel",
                {**_MOE_ARGS, **_MOE_UP, "x_ptr": "*bf16"},
                {"HAS_SCALE": False, "HAS_DELTA": delta, **_MOE_BLOCKS},
            ),
            Kernel(
                _MOE,
                "_down_kernel",
                {**_MOE_ARGS, "h_ptr": "*bf16", "y_ptr": "*bf16", "hs_ptr": "*fp32"},
                {"HAS_SCALE": False, "HAS_DELTA": delta, **_MOE_BLOCKS},
            ),
            Kernel(
                _MOE,
                "_up_kernel",
                {**_MOE_FP8, **_MOE_UP, "x_ptr": "*bf16"},
                {"HAS_SCALE": True, "HAS_DELTA": delta, **_MOE_BLOCKS},
                min_arch=89,  # FP8 expert weights: every chip with FP8 units (fp8_experts.py)
            ),
            Kernel(  # split-K, wide K steps (the decode tiles)
                _MOE,
                "_down_kernel",
                {**_MOE_FP8, "h_ptr": "*bf16", "y_ptr": "*bf16", "hs_ptr": "*fp32"},
                {"HAS_SCALE": True, "HAS_DELTA": delta, **_MOE_BLOCKS, "SPLIT": 2, "BK": 128},
                min_arch=89,
            ),
            Kernel(
                _MOE,
                "_up_reduce_kernel",
                {**_MOE_ARGS, "h_ptr": "*bf16"},
                {"HAS_SCALE": True, "HAS_DELTA": delta, "SPLIT": 2, "BM": 16, "BN": 64},
            ),
            Kernel(
                _MOE,
                "_down_reduce_kernel",
                {**_MOE_ARGS, "y_ptr": "*bf16"},
                {"HAS_SCALE": True, "HAS_DELTA": delta, "SPLIT": 2, "BM": 16, "BN": 64},
            ),
        )
    ),
    # FP8 activations (prefill): FP8 x FP8 products, a scale per row in the epilogues
    Kernel(
        _MOE,
        "_up_kernel",
        {**_MOE_FP8, **_MOE_UP, "x_ptr": "*fp8e4nv"},
        {"HAS_SCALE": True, "HAS_DELTA": False, "ACT_FP8": True, **_MOE_FP8_ACT_BLOCKS},
        min_arch=89,  # FP8 experts: every chip with FP8 units (fp8_experts.py)
    ),
    *(
        Kernel(
            _MOE,
            "_down_kernel",
            {**_MOE_FP8, "h_ptr": "*fp8e4nv", "y_ptr": "*bf16", "hs_ptr": "*fp32"},
            {
                "HAS_SCALE": True,
                "HAS_DELTA": False,
                "ACT_FP8": True,
                "COLUMNS_FIRST": first,
                **_MOE_FP8_ACT_BLOCKS,
            },
            min_arch=89,  # FP8 experts: every chip with FP8 units (fp8_experts.py)
        )
        for first in (False, True)  # the launch order (moe_triton.COLUMNS_FIRST)
    ),
    *(
        Kernel(
            _MOE,
            name,
            {**_MOE_ARGS, **extra},
            {"HAS_SCALE": False, "HAS_DELTA": False, "COLUMNS_FIRST": True, **_MOE_BLOCKS},
        )
        for name, extra in (
            ("_up_kernel", {**_MOE_UP, "x_ptr": "*bf16"}),
            ("_down_kernel", {"h_ptr": "*bf16", "y_ptr": "*bf16", "hs_ptr": "*fp32"}),
        )
    ),
    *(
        Kernel(
            _ACT_QUANT,
            "_quant_rows_kernel",
            _ACT_QUANT_ARGS,
            {"HAS_PAIRS": pairs, "BLOCK": 2048},
            min_arch=89,  # FP8 types: Ada and newer
        )
        for pairs in (False, True)
    ),
    *(
        Kernel(
            _MOE_ROUTING,
            "_route_kernel",
            _ROUTE,
            {"FROM_LOGITS": logits, "ALIGN": align, "PRECISE": True, **_ROUTE_BLOCKS},
        )
        for logits in (True, False)
        for align in (True, False)
    ),
    Kernel(_MOE_ROUTING, "_align_kernel", _ROUTE, _ROUTE_BLOCKS),
    Kernel(
        _MOE_ROUTING,
        "_combine_kernel",
        {"y_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "dim": "i32", "top_k": "i32"},
        {"BD": 512},
    ),
    Kernel(
        "vlm_server.models.moondream3.moe_norm",
        "_add_combine_layernorm_kernel",
        _COMBINE_NORM,
        {"BLOCK": 2048},
    ),
    Kernel(
        _ATTENTION,
        "_paged_decode_kernel",
        _DECODE,
        {**_SHAPE, "BLOCK_N": 64, "SPLITS": 4, "STATIC_MAX": 512},
    ),
    Kernel(
        _ATTENTION,
        "_combine_kernel",
        {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16"},
        {"SPLITS": 4, "HD": 64},
    ),
    Kernel(_KV_STORE, "_rope_store_kernel", _ROPE, {**_SHAPE, "HALF": 16, "STORE_K": True}),
    Kernel(
        _KV_STORE,
        "_rope_store_kernel",
        _ROPE,
        {**_SHAPE, "HALF": 16, "STORE_K": False, "BLOCK_T": 16},
    ),
    Kernel(
        _ATTENTION,
        "_paged_tile_kernel",
        _TILE,
        {
            **_SHAPE,
            "BLOCK_M": 16,
            "BLOCK_N": 64,
            "SPLITS": 2,
            "STATIC_MAX": 0,
            "PRECISION": "tf32",
        },
    ),
    # Compact KV pages: the store writes 8-bit elements and scales, the attention reads them.
    *(
        kernel
        for element, quant, qmax, arch in _KV_COMPACT
        for kernel in (
            Kernel(
                _KV_STORE,
                "_rope_store_kernel",
                _compact_pools(_ROPE, element),
                {
                    **_SHAPE,
                    "HALF": 16,
                    "STORE_K": True,
                    "STORE_V": True,
                    "QUANT": quant,
                    "QMAX": qmax,
                    "BLOCK_T": 16,
                },
                min_arch=arch,
            ),
            Kernel(
                _ATTENTION,
                "_paged_decode_kernel",
                _compact_pools(_DECODE, element),
                {**_SHAPE, "BLOCK_N": 64, "SPLITS": 4, "STATIC_MAX": 0, "SCALED": True},
                min_arch=arch,
            ),
            Kernel(
                _ATTENTION,
                "_paged_tile_kernel",
                _compact_pools(_TILE, element),
                {
                    **_SHAPE,
                    "BLOCK_M": 16,
                    "BLOCK_N": 64,
                    "SPLITS": 2,
                    "STATIC_MAX": 0,
                    "PRECISION": "tf32",
                    "SCALED": True,
                },
                min_arch=arch,
            ),
        )
    ),
    Kernel(
        "vlm_server.models.common.fused_norm",
        "_add_partials_layernorm_kernel",
        {
            "x_ptr": "*bf16",
            "part_ptr": "*fp32",
            "bias_ptr": "*bf16",
            "extra_ptr": "*fp32",
            "w_ptr": "*bf16",
            "nb_ptr": "*bf16",
            "sum_ptr": "*bf16",
            "out_ptr": "*bf16",
            "rows": "i32",
            "dim": "i32",
            "eps": "fp32",
        },
        {"SPLITS": 4, "HAS_EXTRA": True, "BLOCK": 2048},
    ),
    *(
        Kernel(
            _TAU,
            "_logits_kernel",
            {
                "qkv_ptr": "*bf16",
                "w_ptr": "*bf16",
                "part_ptr": "*fp32",
                "M": "i32",
                "stride_in": "i32",
            },
            {
                **_TAU_SHAPE,
                "BH": 64 if every else 16,
                "BK": 128,
                "ITERS": 3,
                "GELU_ERF": erf,
                "TENSOR_CORES": True,
                "ALL_HEADS": every,
            },
        )
        for erf in (False, True)
        for every in (False, True)
    ),
    *(
        Kernel(
            _TAU,
            "_scale_kernel",
            {
                "qkv_ptr": "*bf16",
                "out_ptr": "*bf16",
                "part_ptr": "*fp32",
                "alpha_ptr": "*bf16",
                "pos_ptr": "*i32",
                "M": "i32",
                "stride_in": "i32",
                "stride_out": "i32",
                "stride_pos": "i32",
            },
            {**_TAU_SHAPE, "SPLITS": 16, "BLOCK_D": 64, "BH": 4, "BF16_POS": bf16},
        )
        for bf16 in (False, True)
    ),
    Kernel(
        "vlm_server.models.common.fused_norm",
        "_add_layernorm_kernel",
        _NORM,
        {"HAS_B": True, "BLOCK": 2048},
    ),
    *(
        Kernel("vlm_server.models.common.fp8_vision", name, signature, consts, min_arch=89)
        for name, signature, consts in (
            ("_add_layernorm_fp8_kernel", _NORM_FP8, {"HAS_A": True, "BLOCK": 2048}),
            (
                "_add_layernorm_fp8_kernel",
                _NORM_FP8,
                {"HAS_A": True, "BLOCK": 2048, "SCALED": True},
            ),
            ("_gelu_fp8_kernel", _GELU_FP8, {"BLOCK": 8192}),
            ("_gelu_fp8_kernel", _GELU_FP8, {"BLOCK": 4096, "TAIL": 256}),
            ("_gelu_fp8_kernel", _GELU_FP8, {"BLOCK": 4096, "TAIL": 256, "SCALED": True}),
        )
    ),
)

# Warps where a launcher passes other than Triton's default.
_WARPS = {
    (_MOE_ROUTING, "_route_kernel"): moe_routing.ROUTE_WARPS,
    (_MOE_ROUTING, "_align_kernel"): moe_routing.ROUTE_WARPS,
    ("vlm_server.models.common.fused_norm", "_add_partials_layernorm_kernel"): (
        fused_norm.PARTIALS_WARPS
    ),
    ("vlm_server.models.common.fp8_vision", "_gelu_fp8_kernel"): fp8_vision.GELU_LAUNCH[1],
}
KERNELS = tuple(
    dataclasses.replace(k, warps=_WARPS.get((k.module, k.name), k.warps)) for k in KERNELS
)

# The decode step's kernels again as they launch early (models/common/launch_overlap.py):
# griddepcontrol exists from sm_90 on, and the switch stays off on older chips.
_OVERLAPPING = {
    (_SKINNY, "_skinny_kernel"),
    (_SKINNY, "_split_sum_kernel"),
    (_ATTENTION, "_paged_decode_kernel"),
    (_ATTENTION, "_combine_kernel"),
    (_KV_STORE, "_rope_store_kernel"),
    (_ATTENTION, "_paged_tile_kernel"),
    ("vlm_server.models.common.fused_norm", "_add_partials_layernorm_kernel"),
    ("vlm_server.models.common.fused_norm", "_add_layernorm_kernel"),
}
KERNELS += tuple(
    dataclasses.replace(k, constants={**k.constants, "PDL": True}, min_arch=90)
    for k in KERNELS
    if (k.module, k.name) in _OVERLAPPING
)


def jit_function(kernel: Kernel) -> Any:
    # Imported, not skipped when missing: a kernel whose module moved must fail here until
    # KERNELS follows it.
    module = importlib.import_module(kernel.module)
    fn = getattr(module, kernel.name, None)
    assert fn is not None, f"{kernel.module}.{kernel.name} is gone: update KERNELS"
    return fn


def source(fn: Any, kernel: Kernel) -> Any:
    """The kernel as Triton's compiler takes it, whichever API this Triton has."""
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    defaults = {
        n: p.default
        for n, p in inspect.signature(fn.fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    kernel = dataclasses.replace(kernel, constants={**defaults, **kernel.constants})
    missing = set(names) - set(kernel.signature) - set(kernel.constants)
    assert not missing, f"{kernel.name}: no type for {sorted(missing)}: update KERNELS"
    if "constexprs" in inspect.signature(ASTSource).parameters:  # Triton >= 3.2
        signature = {n: kernel.signature.get(n, "constexpr") for n in names}
        constexprs = {(names.index(k),): v for k, v in kernel.constants.items()}
        return ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    signature = {names.index(n): t for n, t in kernel.signature.items()}  # Triton 3.0, 3.1
    constants = {names.index(k): v for k, v in kernel.constants.items()}
    return ASTSource(fn=fn, signature=signature, constants=constants)
