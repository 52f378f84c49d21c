"""Early launches (models/common/launch_overlap.py) on the GPU: the decode step's kernels,
captured in a CUDA graph and launched while their predecessors finish, give the same bits as
the same kernels launched one after another; and the served engine's idle-prefill mode takes
them only while no prefill runs, with the same tokens."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from image_pipeline import PreparedImage
from tests.test_engine import _finish_all, _text_requests, images  # noqa: F401  (fixture)
from vlm_server.models.common import launch_overlap
from vlm_server.models.interface import LoadedModel
from vlm_server.server.in_process import InProcessEngine

pytestmark = pytest.mark.gpu


@pytest.fixture
def overlap_off_after():
    yield
    launch_overlap.enable(False, "cuda")


def _needs_hopper() -> None:
    if not launch_overlap.supported("cuda"):
        pytest.skip("early launches need compute capability 9.0+")


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_a_graphed_decode_forward_launched_early_is_bit_exact(
    tiny: LoadedModel, rows: int, overlap_off_after: None
) -> None:
    """The fused few-row forward (skinny products, rotary + KV write, paged attention and its
    merge, the norms) in bf16: eager without early launches, then a graph captured with them,
    replayed on new inputs each time: outputs and written KV equal bit for bit."""
    _early_graph_is_bit_exact(copy.deepcopy(tiny.model), rows)


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_moondream3s_decode_forward_launched_early_is_bit_exact(
    rows: int, overlap_off_after: None
) -> None:
    """The same for Moondream 3's tiny preset: tau kernels, routing, the grouped expert
    kernels and the combine inside the next norm launch early as well."""
    from vlm_server.models.registry import preset, random_model

    loaded = random_model(preset("md3-tiny"), seed=rows, dtype=torch.float32, progress=False)
    _early_graph_is_bit_exact(loaded.model, rows)


def _early_graph_is_bit_exact(model: torch.nn.Module, rows: int) -> None:
    _needs_hopper()
    from vlm_server.engine.device.kernels.paged_attention import DecodeKV

    model = model.cuda().to(torch.bfloat16)
    text = model.text
    text.reset_rotary("cuda")
    assert text.use_fused_products(True)
    cfg = text.cfg
    page, per_row = 16, 4
    g = torch.Generator(device="cuda").manual_seed(rows)
    shape = (rows * per_row + 1, page, cfg.n_kv_heads, cfg.head_dim)

    def pools() -> list[torch.Tensor]:
        return [
            torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(cfg.n_layers)
        ]

    k0, v0 = pools(), pools()
    table = torch.arange(1, rows * per_row + 1, device="cuda", dtype=torch.int32)
    table = table.view(rows, per_row)
    row_ids = torch.arange(rows, device="cuda", dtype=torch.int32)
    positions = torch.zeros(rows, 1, device="cuda", dtype=torch.long)
    x = torch.zeros(rows, 1, cfg.dim, device="cuda", dtype=torch.bfloat16)
    ks, vs = [k.clone() for k in k0], [v.clone() for v in v0]
    cache = DecodeKV(
        ks, vs, table, row_ids, per_row, (text.rope_cos, text.rope_sin), cfg.n_heads, True
    )

    def forward() -> torch.Tensor:
        return text.logits(text(x, positions, cache))

    def fresh_inputs() -> None:
        positions.copy_(torch.randint(0, per_row * page, (rows, 1), device="cuda", generator=g))
        x.copy_(torch.randn(rows, 1, cfg.dim, device="cuda", generator=g).bfloat16())
        for k, v, a, b in zip(ks, vs, k0, v0, strict=True):
            k.copy_(a)
            v.copy_(b)

    launch_overlap.enable(False, "cuda")
    wants = []
    for _ in range(3):
        fresh_inputs()
        wants.append((forward().clone(), [k.clone() for k in ks], [v.clone() for v in vs]))
    assert launch_overlap.enable(True, "cuda")
    fresh_inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # compiles the early-launching variants outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    g.manual_seed(rows)  # the same inputs again, in the same order
    k0[:], v0[:] = pools(), pools()
    for want, want_k, want_v in wants:
        fresh_inputs()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert all(torch.equal(a, b) for a, b in zip(ks, want_k, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(vs, want_v, strict=True))


def test_the_switch_stays_off_where_the_chip_cannot(overlap_off_after: None) -> None:
    major, _ = torch.cuda.get_device_capability()
    assert launch_overlap.enable(True, "cuda") == (major >= 9)
    assert launch_overlap.enable(True, "cpu") is False
    assert launch_overlap.kernel_args() == {}


@pytest.mark.parametrize("prefill", ["none", "partition", "whole GPU"])
def test_steps_without_a_prefill_in_flight_take_the_early_graphs(
    text_model: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    prefill: str,
    overlap_off_after: None,
) -> None:
    """``--launch-overlap idle``: a second set of decode and mixed-step graphs captured with
    early launches. Decode steps replay them while no prefix batch is in flight; mixed steps
    also while the batches in flight are all in the SM partition; none while one has the
    whole GPU. The switch stays off for everything else, and the tokens equal those of
    ``off``."""
    _needs_hopper()
    model = copy.deepcopy(text_model.model).cuda().to(torch.bfloat16)
    loaded = LoadedModel(model, text_model.tokenizer, text_model.config, text_model.source)
    reqs = _text_requests(images)
    runtimes = {}

    def check_with(mode: str) -> Callable[[InProcessEngine], None]:
        def check(engine: InProcessEngine) -> None:
            rt = engine.batched.runtime
            runtimes[mode] = rt
            assert rt.launch_overlap == mode
            assert bool(rt.steps.early_decode_graphs) == (mode == "idle")
            assert bool(rt.steps.early_mixed_graphs) == (mode == "idle")
            assert not launch_overlap.enabled()  # captured inside; nothing else launches early
            if prefill != "none":  # a batch stands in flight for the whole run
                rt.steps.prefill_busy = lambda: True
                rt.steps.prefill_contends = lambda: prefill == "whole GPU"

        return check

    got = {
        mode: _finish_all(loaded, reqs, 2, check_with(mode), max_batch_size=4, launch_overlap=mode)
        for mode in ("off", "idle")
    }
    assert [f.text for f in got["idle"]] == [f.text for f in got["off"]]
    off, idle = runtimes["off"].steps, runtimes["idle"].steps
    assert off.early_steps == off.early_mixed_steps == 0
    assert (idle.early_steps > 0) is (prefill == "none")
    assert (idle.early_mixed_steps > 0) is (prefill != "whole GPU")
