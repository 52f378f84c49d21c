"""The paged KV cache on the device: one tensor holding every layer's keys and values, the
block table that maps each row's positions to pages, and the attention views the forwards
read and write the pool through.

The scheduler owns the pages (core/pages.py): its allocator writes block-table rows in place
into this pool's pinned host mirror and hands the rows it changed to the next launch, which
uploads them with one copy (`upload_rows`) ahead of the step's inputs. The pool is sized
once, from the KV budget, in the format of ``kv_dtype`` (a compact one: int8 or FP8 elements
and an fp32 scale per position and KV head beside them, models/kv.py `quantize_kv`).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from vlm_server.chip_features import fp8_supported
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import CPU_KV_BUDGET, default_kv_budget, kv_pages
from vlm_server.engine.device.buffers import copy_rows, zeros
from vlm_server.engine.device.kernels.paged_attention import (
    DecodeKV,
    PagedKV,
    PrefixKV,
    PrefixPromptKV,
    RaggedKV,
)
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.device.streams import Device
from vlm_server.models.kv import compact


def triton_available() -> bool:
    from vlm_server.engine.device.kernels import triton_attention

    return triton_attention.AVAILABLE


def release_cache(device: torch.device) -> None:
    """Give the device back what the allocator caches unused (start-up only: it waits for
    the device). Start-up frees tensors: stacking Moondream 2's fused decode products frees
    its unstacked weights, 2.3 GiB of segments no later tensor of the same sizes reuses.
    Kept, they would stay the allocator's high-water mark until the first graph capture
    empties the cache, with the KV pool on top."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # start-up, before the KV pool is sized: not in any tick


def default_budget(device: torch.device, cap: int | None = None) -> int:
    """KV bytes when the config names none (start-up only): the memory plan's rule over what
    this process measures, the bytes live tensors hold and what the allocator could still
    hand out (the device's free memory and its own unused cache), under ``cap`` (the engine's
    memory cap) when one is set."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - held  # handed out before asking the device
        return default_kv_budget(free + cached, held, cap)
    return CPU_KV_BUDGET


class KVPool:
    """Keys, values and block table of every row (and the pad row) of the engine."""

    def __init__(self, dev: Device, entry: ModelEntryPoints, cfg: EngineConfig) -> None:
        self.dev, self.entry = dev, entry
        release_cache(entry.device)
        self.kv_format = entry.kv_format(cfg.kv_dtype)
        storage = entry.kv_storage(self.kv_format)
        if storage == torch.float8_e4m3fn and dev.is_cuda and not fp8_supported(entry.device):
            raise ValueError(
                "kv_dtype fp8 needs FP8 conversions (compute capability 8.9 or newer): use "
                "int8 (the same bytes)"
            )
        budget = cfg.kv_budget_bytes or default_budget(entry.device, cfg.gpu_memory_bytes)
        self.n_pages = kv_pages(budget, entry.kv_page_bytes(cfg.page_size, self.kv_format))
        shape = entry.kv_shape(self.n_pages, cfg.page_size)
        # One tensor for every layer's keys and values: a page copy is one op for all layers.
        self.kv = dev.buffer("kv", zeros(shape, storage, entry.device))
        self.k_pools, self.v_pools = list(self.kv[0]), list(self.kv[1])
        # A compact format's scales, [2, layers, pages, page_size, kv heads]: read and written
        # exactly with their pages (the accesses the steps declare on `kv` cover them).
        self.kv_scales: torch.Tensor | None = None
        self.scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        if compact(storage):
            self.kv_scales = zeros(shape[:-1], torch.float32, entry.device)
            self.scales = (list(self.kv_scales[0]), list(self.kv_scales[1]))
        rows, max_pages = cfg.max_rows, -(-entry.max_context // cfg.page_size)
        # One extra row pads graph buckets: its block-table row stays on the sink page.
        self.block_host = dev.host_buffer("block_host", (rows + 1, max_pages), torch.int32)
        self.block_dev = dev.buffer(
            "block_dev", zeros((rows + 1, max_pages), torch.int32, entry.device)
        )
        # The scheduler's rows of the mirror, which its page allocator writes in place.
        self.block_table: np.ndarray = self.block_host.numpy()[:rows]
        # Attention in the Triton kernels (CUDA), else in PyTorch; one switch for every view.
        self.use_triton = dev.is_cuda and triton_available()
        if self.use_triton and not entry.fused_attention:
            raise ValueError(
                "this model family's decoder has no fused attention path (attend_packed), "
                "which the CUDA kernels need: serve it with --device cpu"
            )

    def upload_rows(self, stage: torch.Tensor, rows: tuple[int, ...]) -> None:
        """Enqueue on the copy stream the block-table ``rows`` (ascending; none: nothing),
        staged in ``stage``, a slot's pinned copy of the mirror: the mirror may change again
        while this copy is queued, the slot's stage only after the commit that frees it."""
        if not rows:
            return
        lo, hi = rows[0], rows[-1] + 1  # one copy covering every dirty row
        # A view of the pinned host mirror: no device sync.
        self.dev.host_write(stage, self.block_host.numpy()[lo:hi], start=lo)
        self.dev.copy(
            self.dev.copy_stream,
            "h2d block rows",
            partial(copy_rows, self.block_dev, stage, lo, hi),
            # Rows between dirty ones are rewritten with the values they hold: only the dirty
            # rows change, and only they may be read by no step still queued.
            lambda: ([stage], [(self.block_dev, rows)]),
        )

    def copy_pages(self, pairs: torch.Tensor) -> None:
        """Page ``pairs[i, 0]`` into page ``pairs[i, 1]``, every layer's keys and values (and
        their scales) in one gather and one scatter (``pairs`` on the device: no host sync)."""
        self.kv[:, :, pairs[:, 1]] = self.kv[:, :, pairs[:, 0]]
        if self.kv_scales is not None:
            self.kv_scales[:, :, pairs[:, 1]] = self.kv_scales[:, :, pairs[:, 0]]

    # ---- attention views (a forward's `KVCache`) --------------------------------------

    def decode_view(self, rows: torch.Tensor, n_blocks: int) -> DecodeKV:
        """One new position per ``rows`` entry (block-table rows); PyTorch attends over the
        first ``n_blocks`` pages, the Triton kernels up to each row's position."""
        return DecodeKV(
            self.k_pools,
            self.v_pools,
            self.block_dev,
            rows,
            n_blocks,
            self.entry.rope,
            self.entry.n_heads,
            self.use_triton,
            scales=self.scales,
        )

    def token_view(self, rows: torch.Tensor, tiles: torch.Tensor, tile_tokens: int) -> DecodeKV:
        """A mixed step's tokens on CUDA: each token a row of the rotary + KV-write kernel,
        attention per tile of a row's consecutive tokens (core/mixed_inputs.py)."""
        return DecodeKV(
            self.k_pools,
            self.v_pools,
            self.block_dev,
            rows,
            0,
            self.entry.rope,
            self.entry.n_heads,
            True,
            tiles=tiles,
            tile_tokens=tile_tokens,
            scales=self.scales,
        )

    def ragged_view(self, rows: torch.Tensor, n_blocks: int) -> RaggedKV:
        """A mixed step's tokens in PyTorch (varlen attention over the first ``n_blocks``)."""
        return RaggedKV(
            self.k_pools, self.v_pools, self.block_dev, rows, n_blocks, scales=self.scales
        )

    def prefix_view(
        self, pages: torch.Tensor, k: int, length: int, image_of_token: torch.Tensor
    ) -> PrefixKV | PagedKV:
        """The BOS + image forward of ``k`` prefixes of ``length`` positions straight into
        their ``pages`` (a row per prefix); a prefix attends only to itself, both ways."""
        if self.use_triton:
            return PrefixKV(
                self.k_pools,
                self.v_pools,
                pages,
                image_of_token,
                self.entry.rope,
                self.entry.n_heads,
                scales=self.scales,
            )
        return PagedKV(
            self.k_pools, self.v_pools, pages[:k], length, fresh_prefix=True, scales=self.scales
        )

    def prefix_prompt_view(
        self,
        pages: torch.Tensor,
        k: int,
        length: int,
        image_of_token: torch.Tensor,
        rows: torch.Tensor,
        pos: torch.Tensor,
        tiles: torch.Tensor,
        tile_tokens: int,
    ) -> PrefixPromptKV:
        """``prefix_view`` with riding prompt tokens after the prefixes (``rows``, ``pos``:
        each prompt token's row of ``pages`` and position; ``tiles``: the Triton path's)."""
        return PrefixPromptKV(
            self.k_pools,
            self.v_pools,
            pages,
            k,
            length,
            image_of_token,
            rows,
            pos,
            self.entry.rope,
            self.entry.n_heads,
            tiles if self.use_triton else None,
            tile_tokens,
            scales=self.scales,
        )
