"""The engine's memory plan for a card, computed from shapes alone (torch-free: nothing is
allocated, no device is needed).

The engine's own decisions, in one place, so that `vlm plan` (before anything is downloaded)
and the engine at start read the same rules:

- the KV budget: ``kv_budget_bytes`` when set, else `KV_SHARE_OF_FREE` of what the allocator
  could still hand out when the KV pool is sized (under ``gpu_memory_bytes`` when set),
  `default_kv_budget`: the engine passes what it measures there, the plan what it estimates
  is held by then (the weights and `start_tensors`);
- the KV pages of that budget, `kv_pages` (the KV pool allocates exactly these);
- what a picture request takes of them: its image prefix (shared by every request for the same
  picture, its partly filled last page copied into each request's own first page), its prompt
  and its answer, `picture_request_pages` (the prefix cache and the headroom count the same);
- graph pools and fixed buffers, estimated from the shapes of the largest work each holds.

A format is a number of bytes per element (`WEIGHT_FORMATS`, `KV_FORMATS`): a new one is one
more entry; int8 and int4 hold the decoder's linears in 8 or 4 bits, scales included; fp8 and
int8 keys and values one byte an element plus `KV_SCALE_BYTES` per position and KV head;
``vision_weights`` int8 and int4 hold the vision tower's block linears so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlm_server.chips import FP8_CAPABILITY
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.models.interface import KVShape, MemoryShape

# The default KV budget's share of the memory free after loading (kv_pool.default_budget).
KV_SHARE_OF_FREE = 0.4
# The default KV budget off CUDA.
CPU_KV_BUDGET = 256 << 20
# The FP8 vision tower pads its MLP's inner width to a multiple of this for fc2's FP8 product
# (models/common/fp8_vision.py `Fp8Tower`).
FP8_VISION_PAD = 128
# Device memory the CUDA context and the libraries' handles take outside PyTorch's allocator
# (an estimate: about 0.5 GiB on an H100 with cuBLAS and Triton loaded). It is not under the
# --gpu-memory cap, which binds the allocator only.
CUDA_CONTEXT_BYTES = 512 << 20
# A typical interactive request (core/headroom.py): a picture, a question of a few dozen
# tokens and the default output budget.
TYPICAL_PROMPT_TOKENS = 64
TYPICAL_MAX_TOKENS = GenerationRequest(Task.QUERY, None).max_tokens


@dataclass(frozen=True)
class WeightFormat:
    """How weights are held: bytes per parameter of the dense tensors and of the expert
    stacks, and the scale bytes per expert output row (FP8 experts: one fp32 per row); for
    4- and 8-bit weights, the bits of the decoder's linears (`MemoryShape.linear_params`) and
    their scales' group (0: one per output row)."""

    name: str
    dense_bytes: float
    expert_bytes: float
    expert_row_scale_bytes: int = 0
    experts_only: bool = False  # a format of the expert stacks (a mixture-of-experts model)
    min_capability: tuple[int, int] = (0, 0)  # the compute capability its kernels need
    activation_dtype: str = "bf16"  # activations, and so the KV pages (today: the same)
    linear_bits: int = 0  # 0: the decoder's linears are dense tensors like the rest
    group_size: int = 0


# The 4- and 8-bit formats' scales (docs/quantization.md): bf16, one per output row (INT8) or
# per group of input columns of a row (INT4).
QUANT_SCALE_BYTES = 2
INT4_GROUP = 128


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 2, 2),
    "fp16": WeightFormat("fp16", 2, 2, activation_dtype="fp16"),
    "fp32": WeightFormat("fp32", 4, 4, activation_dtype="fp32"),
    # Moondream 3's FP8 checkpoint: experts kept in FP8 (one fp32 scale per row) where the
    # fused expert kernels take them (chips with FP8 units: Ada and newer), the rest in bf16.
    # --weights fp8 is this format: kept from the FP8 checkpoint, or quantized at load.
    "fp8-experts": WeightFormat(
        "fp8-experts",
        2,
        1,
        expert_row_scale_bytes=4,
        experts_only=True,
        min_capability=FP8_CAPABILITY,
    ),
    # The decoder's linears in 8 or 4 bits (--weights), Moondream 3's expert stacks too (INT8:
    # a byte a weight and a bf16 scale a row; INT4: half a byte and a bf16 scale per group of
    # 128 input columns), everything else in bf16.
    "int8": WeightFormat("int8", 2, 1, expert_row_scale_bytes=QUANT_SCALE_BYTES, linear_bits=8),
    "int4": WeightFormat(
        "int4", 2, 0.5 + QUANT_SCALE_BYTES / INT4_GROUP, linear_bits=4, group_size=INT4_GROUP
    ),
}
# Bytes per key or value element (models/interface.py `KVFormat`; `--kv-dtype`).
KV_FORMATS: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "int8": 1}
# The compact formats' scales: one fp32 per (position, KV head) of the keys and of the values
# (models/kv.py `quantize_kv`).
KV_SCALE_BYTES: dict[str, int] = {"fp8": 4, "int8": 4}
# The chips a KV format needs (FP8 conversions: compute capability 8.9 and newer).
KV_MIN_CAPABILITY: dict[str, tuple[int, int]] = {"fp8": (8, 9)}


def kv_format_of(kv_dtype: str, activations: str) -> str:
    """The KV format of ``--kv-dtype`` with activations in ``activations`` (auto: theirs, for
    now: the exact default). A 16-bit one other than the activations' is refused: the kernels
    read exact pages in the activations' dtype."""
    if kv_dtype == "auto":
        return activations
    if kv_dtype not in KV_FORMATS:
        raise ValueError(f"kv_dtype: {kv_dtype!r} is not one of auto, {', '.join(KV_FORMATS)}")
    if kv_dtype not in KV_SCALE_BYTES and kv_dtype != activations:
        raise ValueError(
            f"kv_dtype: the engine keeps exact keys and values in the activations' dtype "
            f"({activations}), not {kv_dtype}: use auto, fp8 or int8"
        )
    return kv_dtype


def kv_page_bytes(kv: KVShape, page_size: int, kv_format: str) -> int:
    """Bytes of one KV page (every layer's keys and values) in ``kv_format``, scales included:
    the KV pool's pages and the plan's."""
    return kv.page_bytes(page_size, KV_FORMATS[kv_format], KV_SCALE_BYTES.get(kv_format, 0))


def weight_bytes(shape: MemoryShape, fmt: WeightFormat, vision: str = "exact") -> dict[str, int]:
    """Bytes of each part of ``shape``'s weights held in ``fmt``, the vision tower's block
    linears in ``vision`` (``--vision-weights``: exact, int8, int4)."""
    out = {}
    for part, n in shape.params.items():
        if part == "experts":
            out[part] = int(n * fmt.expert_bytes) + shape.expert_rows * fmt.expert_row_scale_bytes
        elif part == "text" and fmt.linear_bits:
            out[part] = int((n - shape.linear_params) * fmt.dense_bytes) + _linear_bytes(shape, fmt)
        elif part == "vision" and vision != "exact":
            out[part] = _tower_bytes(shape, n, fmt.dense_bytes, WEIGHT_FORMATS[vision])
        else:
            out[part] = int(n * fmt.dense_bytes)
    return out


def _tower_bytes(shape: MemoryShape, params: int, dense_bytes: float, fmt: WeightFormat) -> int:
    """The tower's ``params`` with its block linears in ``fmt``'s bits, scales included; an
    INT4 linear whose inputs are not a multiple of the group stays dense (as loading keeps
    it), like everything else of the tower."""
    quantized = dense = 0
    for rows, cols in shape.vision_linears:
        if fmt.group_size and cols % fmt.group_size:
            continue
        scales = rows if fmt.group_size == 0 else rows * cols // fmt.group_size
        quantized += rows * cols * fmt.linear_bits // 8 + scales * QUANT_SCALE_BYTES
        dense += rows * cols
    return int((params - dense) * dense_bytes) + quantized


def _linear_bytes(shape: MemoryShape, fmt: WeightFormat) -> int:
    """The decoder's linears in ``fmt``'s bits, scales included."""
    n = shape.linear_params
    scales = shape.linear_rows if fmt.group_size == 0 else n // fmt.group_size
    return n * fmt.linear_bits // 8 + scales * QUANT_SCALE_BYTES


def default_kv_budget(free: int, held: int, cap: int | None = None) -> int:
    """The KV bytes when none are configured, one rule for the engine and the plan:
    `KV_SHARE_OF_FREE` of the memory the allocator could still hand out when the KV pool is
    sized, ``free`` (the device's, and what the allocator caches unused), or of what ``cap``
    leaves above the ``held`` bytes of live tensors when less."""
    if cap:
        free = min(free, cap - held)
    return max(0, int(free * KV_SHARE_OF_FREE))


def kv_pages(budget: int, page_bytes: int) -> int:
    """Pages of a KV budget (at least two: the sink and one to hand out)."""
    return max(2, budget // page_bytes)


def fp8_vision_block_bytes(enc_dim: int, enc_ff_dim: int) -> int:
    """Bytes one vision block's FP8 copies hold (models/common/fp8_vision.py `Fp8Weight`):
    QKV, fc1 and fc2 (its inputs padded) in e4m3, each with an fp32 scale and a bf16 bias per
    output row and one fp32 unit scale."""
    padded = -(-enc_ff_dim // FP8_VISION_PAD) * FP8_VISION_PAD
    products = ((3 * enc_dim, enc_dim), (enc_ff_dim, enc_dim), (enc_dim, padded))
    return sum(rows * cols + rows * (4 + 2) + 4 for rows, cols in products)


def planned_vision_fp8(cfg: EngineConfig, fmt: WeightFormat) -> bool:
    """Whether the tower holds FP8 copies: as asked, or for auto (None) in an FP8 build with
    an exact tower, as device/model_entry.py `fp8_vision_choice` decides where the format's
    FP8 experts are held (chips with FP8 units)."""
    if cfg.vision_fp8 is not None:
        return cfg.vision_fp8
    return fmt.name == "fp8-experts" and cfg.vision_weights == "exact"


def start_tensors(
    shape: MemoryShape, cfg: EngineConfig, fmt: WeightFormat, cuda: bool
) -> dict[str, int]:
    """Bytes held beside the weights when the KV pool is sized (kv_pool.py): the decoder's
    rotary tables and, on CUDA, what the runtime's switches derive from the weights before it
    (engine/device/runtime.py): the fused decode products' stacks, the FP8 vision copies.

    Tensors freed by then do not count: the pool releases the allocator's cache first."""
    out = {"rotary tables": 2 * shape.max_context * (shape.rotary_dim // 2) * 4}
    # Stacking moves the weights (16-bit or quantized) and adds one 16-bit bias a block.
    if cuda and cfg.fused_decode and shape.fused_elements:
        out["fused decode stacks"] = int(shape.fused_elements * fmt.dense_bytes)
    if cuda and planned_vision_fp8(cfg, fmt) and shape.enc_layers:
        block = fp8_vision_block_bytes(shape.enc_dim, shape.enc_ff_dim)
        out["FP8 vision weights"] = shape.enc_layers * block
    return out


def pages_for(positions: int, page_size: int) -> int:
    return -(-positions // page_size)


def picture_request_pages(positions: int, prefix_len: int, page_size: int) -> int:
    """Free pages a sequence of ``positions`` (its image prefix included) takes when its
    prefix is not cached: the new prefix's pages, and its own beyond the prefix's full pages
    (its copy of a partly filled last page included)."""
    prefix_pages = pages_for(prefix_len, page_size)
    shared = prefix_len // page_size  # full pages, shared read-only
    return pages_for(positions, page_size) - shared + prefix_pages


def typical_positions(prefix_len: int, row_positions: int) -> int:
    """Positions of a typical picture request, within a block-table row of ``row_positions``
    (the headroom's page reserve counts the same request)."""
    return min(prefix_len + TYPICAL_PROMPT_TOKENS + TYPICAL_MAX_TOKENS, row_positions)


def workspaces(shape: MemoryShape, cfg: EngineConfig, act: int, cuda: bool) -> dict[str, int]:
    """Estimated bytes of the fixed buffers and graph pools beside weights and KV pages.

    Each graph pool holds the live activations of the largest forward captured in it
    (graphs of one kind share a pool, largest first): a forward over ``t`` tokens keeps the
    residual stream and a few activations of the widest layer alive at once."""
    rows = cfg.max_rows + 1

    def forward(t: int) -> int:
        # The widest layer's MLP: dense (fc1 and its GELU) or routed (each token's top-k
        # copies, their fc1 of twice the expert width), whichever is larger.
        mlp = max(2 * shape.ff_dim, shape.top_k * 3 * shape.expert_dim)
        return t * (4 * shape.dim + shape.qkv_dim + mlp) * act

    crops = 1 + shape.max_crops
    patches = crops * shape.n_patches
    fixed = {
        "step buffers": (4 * rows + 3 * rows * cfg.max_spatial_refs) * shape.dim * act,
        "mask table": cfg.mask_table_rows * shape.vocab_size,
        "prefix embeddings": cfg.max_prefill_batch * shape.prefix_len * shape.dim * act,
    }
    if not cuda:
        return fixed
    prefix_tokens = cfg.max_prefill_batch * shape.prefix_len + cfg.prefix_prompt_tokens
    graphs = {
        "graphs: decode": forward(cfg.max_batch_size) + rows * shape.vocab_size * 4,
        "graphs: mixed step": forward(cfg.max_step_tokens) + rows * shape.vocab_size * 4,
        "graphs: sampling": 2 * rows * shape.vocab_size * 4,
        "graphs: image prefix": forward(prefix_tokens),
        "graphs: image path": patches * (4 * shape.enc_dim + 2 * shape.enc_ff_dim) * act
        + shape.n_patches * (2 * shape.enc_dim + shape.proj_inner_dim) * act,
    }
    return fixed | graphs


@dataclass(frozen=True)
class MemoryPlan:
    """Where a card's memory goes, as the engine would spend it."""

    card_bytes: int  # the device's memory
    cap_bytes: int | None  # --gpu-memory
    context_bytes: int  # outside the allocator
    limit_bytes: int  # what the allocator may hold
    weights: dict[str, int]
    start_tensors: dict[str, int]  # held beside the weights when the KV pool is sized
    weights_format: str
    kv_format: str
    kv_budget_bytes: int
    page_size: int
    page_bytes: int
    kv_pages: int  # the pool's pages, the sink included
    prefix_pages: int  # one picture's prefix
    request_pages: int  # a typical request on a new picture
    request_own_pages: int  # a typical request on a picture already cached
    workspaces: dict[str, int]
    max_batch_size: int
    vision_weights: str = "exact"  # the tower's block linears (--vision-weights)
    notes: tuple[str, ...] = field(default=())

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def held_at_kv_sizing(self) -> int:
        """What live tensors hold when the KV pool is sized (the default budget's ``held``)."""
        return self.weight_bytes + sum(self.start_tensors.values())

    @property
    def kv_bytes(self) -> int:
        return self.kv_pages * self.page_bytes

    @property
    def workspace_bytes(self) -> int:
        return sum(self.workspaces.values())

    @property
    def peak_bytes(self) -> int:
        """What the allocator holds at its peak (torch.cuda.max_memory_reserved)."""
        return self.held_at_kv_sizing + self.kv_bytes + self.workspace_bytes

    @property
    def left_bytes(self) -> int:
        return self.limit_bytes - self.peak_bytes

    @property
    def usable_pages(self) -> int:
        return self.kv_pages - 1  # page 0 is the sink

    @property
    def prefixes_held(self) -> int:
        """Picture prefixes the pages hold with nothing else running."""
        return self.usable_pages // self.prefix_pages

    @property
    def requests_held(self) -> int:
        """Typical requests running at once, each on a picture of its own."""
        return self.usable_pages // self.request_pages

    @property
    def requests_held_one_picture(self) -> int:
        """Typical requests running at once, all on one picture."""
        return (self.usable_pages - self.prefix_pages) // self.request_own_pages

    @property
    def fits_memory(self) -> bool:
        return self.left_bytes >= 0

    @property
    def fits_batch(self) -> bool:
        return self.requests_held >= self.max_batch_size

    @property
    def fits(self) -> bool:
        return self.fits_memory and self.fits_batch

    @property
    def kv_needed_bytes(self) -> int:
        """The KV budget ``max_batch_size`` requests on pictures of their own need."""
        return (self.max_batch_size * self.request_pages + 1) * self.page_bytes

    @property
    def needed_bytes(self) -> int:
        """Device memory (the context included) that holds ``max_batch_size`` requests."""
        kv = max(self.kv_bytes, self.kv_needed_bytes)
        return self.context_bytes + self.held_at_kv_sizing + kv + self.workspace_bytes


def plan_memory(
    shape: MemoryShape,
    cfg: EngineConfig,
    card_bytes: int,
    weights_format: str = "bf16",
    kv_format: str | None = None,
    cuda: bool = True,
) -> MemoryPlan:
    """The plan of ``shape`` served with ``cfg`` on a device of ``card_bytes`` (``cuda``:
    a GPU, with its context and graphs; else the CPU and its default budget);
    ``kv_format``: the KV format an engine resolved already (its activations may differ from
    the format's usual ones, e.g. fp32 beside int8 weights), else ``cfg.kv_dtype``'s."""
    fmt = WEIGHT_FORMATS[weights_format]
    if kv_format is None:
        kv_format = kv_format_of(cfg.kv_dtype, fmt.activation_dtype)
    act = KV_FORMATS[fmt.activation_dtype]
    weights = weight_bytes(shape, fmt, cfg.vision_weights)
    start = start_tensors(shape, cfg, fmt, cuda)
    context = CUDA_CONTEXT_BYTES if cuda else 0
    limit = card_bytes - context
    if cuda and cfg.gpu_memory_bytes:
        limit = min(limit, cfg.gpu_memory_bytes)
    held = sum(weights.values()) + sum(start.values())
    if cfg.kv_budget_bytes:
        budget = cfg.kv_budget_bytes
    elif cuda:
        free = max(0, card_bytes - context - held)
        budget = default_kv_budget(free, held, cfg.gpu_memory_bytes)
    else:
        budget = CPU_KV_BUDGET
    page_bytes = kv_page_bytes(shape.kv, cfg.page_size, kv_format)
    row_positions = pages_for(shape.max_context, cfg.page_size) * cfg.page_size
    positions = typical_positions(shape.prefix_len, row_positions)
    request = picture_request_pages(positions, shape.prefix_len, cfg.page_size)
    prefix = pages_for(shape.prefix_len, cfg.page_size)
    return MemoryPlan(
        card_bytes=card_bytes,
        cap_bytes=cfg.gpu_memory_bytes,
        context_bytes=context,
        limit_bytes=limit,
        weights=weights,
        start_tensors=start,
        weights_format=weights_format,
        kv_format=kv_format,
        kv_budget_bytes=budget,
        page_size=cfg.page_size,
        page_bytes=page_bytes,
        kv_pages=kv_pages(budget, page_bytes),
        prefix_pages=prefix,
        request_pages=request,
        request_own_pages=request - prefix,
        workspaces=workspaces(shape, cfg, act, cuda),
        max_batch_size=cfg.max_batch_size,
        vision_weights=cfg.vision_weights,
    )
