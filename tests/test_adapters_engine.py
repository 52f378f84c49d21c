"""Finetune adapters in the batched engine: token equality with the reference (which applies
LoRA as moondream/torch does), mixed batches, image prefixes keyed by (image, adapter),
eviction under pressure, and errors naming the field."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from image_pipeline import (
    PreparedImage,
    prepare_image,
    prepare_pil,
    sample_image,
    sample_image_bytes,
)
from tests.support.reference_memo import shared_reference
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)
from vlm_server.engine.api import (
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    Task,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.models.lora import bank, files
from vlm_server.models.lora.bank import exact_lora
from vlm_server.models.lora.spec import AdapterWeights
from vlm_server.models.lora.writer import write_random
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.server.in_process import InProcessEngine

RANK = 4


@pytest.fixture(scope="module")
def adapter_dir(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("adapters")
    targets = tiny.model.text.lora_targets
    for i, name in enumerate(["alpha", "beta", "gamma", "delta@12"]):
        # Large enough to change answers, small enough to keep them sensible.
        write_random(folder, name, targets, rank=RANK - (i % 2), seed=10 + i, scale=0.3)
    return folder


@pytest.fixture(scope="module")
def images() -> list[PreparedImage]:
    base = sample_image()
    return [prepare_pil(base), prepare_pil(base.rotate(90, expand=True))]


def _reference(loaded: LoadedModel, folder: Path, name: str | None) -> ReferenceGenerator:
    def weights() -> AdapterWeights | None:
        if name is None:
            return None
        path = files.find(folder, name)
        assert path is not None
        return files.load(path, loaded.model.text.lora_targets, RANK, name)

    return shared_reference(loaded.model, loaded.tokenizer, weights, adapter_key=(folder, name))


def _want(ref: ReferenceGenerator, req: GenerationRequest) -> str:
    s = SamplingSettings(temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens)
    if req.task is Task.CAPTION:
        return ref.caption(req.image, req.caption_length, s).text
    return ref.query(req.image, req.question, s).text


async def _text(engine: InProcessEngine, req: GenerationRequest) -> str:
    async for event in await engine.submit(req):
        if isinstance(event, Finished):
            return event.text
    raise AssertionError("no result")


def _run(loaded: LoadedModel, folder: Path, reqs: list[GenerationRequest], **kw: object) -> list:
    options: dict = {
        "max_batch_size": 8,
        "kv_budget_bytes": 32 << 20,
        "adapters_dir": str(folder),
        "max_adapter_rank": RANK,
        **kw,
    }

    async def run() -> tuple[list, BatchedEngine]:
        engine = InProcessEngine(BatchedEngine(loaded, EngineConfig(**options)))
        await engine.start()
        try:
            out = await asyncio.gather(*[_text(engine, r) for r in reqs], return_exceptions=True)
            return out, engine
        finally:
            await engine.close()

    out, engine = asyncio.run(run())
    return [*out, engine]


def _requests(images: list[PreparedImage], names: list[str | None]) -> list[GenerationRequest]:
    reqs = []
    for i, name in enumerate(names):
        task = Task.CAPTION if i % 2 == 0 else Task.QUERY
        reqs.append(
            GenerationRequest(
                task,
                images[i % len(images)],
                request_id=f"r{i}",
                question="what is this?",
                temperature=0,
                max_tokens=12,
                adapter=name,
            )
        )
    return reqs


@pytest.mark.parametrize("depth", [1, 2])
def test_an_adapter_request_equals_the_reference(
    tiny: LoadedModel, adapter_dir: Path, images: list[PreparedImage], depth: int
) -> None:
    reqs = _requests(images[:1], ["alpha"])
    *texts, _ = _run(tiny, adapter_dir, reqs, pipeline_depth=depth)
    want = _want(_reference(tiny, adapter_dir, "alpha"), reqs[0])
    base = _want(_reference(tiny, adapter_dir, None), reqs[0])
    assert texts[0] == want
    assert want != base  # the adapter changes the answer


# default: prompts ride their image's prefix batch; chunked: prompts split over mixed steps
# beside decode rows, none riding.
BUDGETS = {"default": {}, "chunked": {"max_step_tokens": 11, "prefix_prompt_tokens": 0}}


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("depth", [1, 2])
def test_a_mixed_batch_equals_each_request_alone(
    tiny: LoadedModel,
    adapter_dir: Path,
    images: list[PreparedImage],
    depth: int,
    budget: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows without an adapter, with alpha, beta and delta share forwards (decode steps,
    mixed steps, prefix batches); each answer is the reference's for its adapter alone."""
    seen: list[set[int]] = []

    def watched(x, a, b, index, ranks):  # type: ignore[no-untyped-def]
        seen.append(set(index.tolist()))
        return exact_lora(x, a, b, index, ranks)

    monkeypatch.setattr(bank, "exact_lora", watched)
    names = [None, "alpha", "beta", None, "beta", "alpha", "delta@12"]
    reqs = _requests(images, names)
    *texts, engine = _run(tiny, adapter_dir, reqs, pipeline_depth=depth, **BUDGETS[budget])
    refs = {n: _reference(tiny, adapter_dir, n) for n in set(names)}
    for req, text in zip(reqs, texts, strict=True):
        assert text == _want(refs[req.adapter], req), (req.request_id, req.adapter)
    assert engine.batched.adapters.slots.pins == [0] * engine.batched.cfg.max_adapters
    assert max(len(slots) for slots in seen) >= 3  # none, and two adapters, in one forward


def test_image_prefixes_are_keyed_by_image_and_adapter(
    tiny: LoadedModel, adapter_dir: Path, images: list[PreparedImage]
) -> None:
    """The same image with two adapters (and none): three prefixes, three answers, each the
    reference's; a repeat of one hits its own prefix."""
    names = ["alpha", "beta", None, "alpha"]
    reqs = [
        GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=12, adapter=n)
        for n in names
    ]
    *texts, engine = _run(tiny, adapter_dir, reqs)
    want = [_want(_reference(tiny, adapter_dir, n), r) for n, r in zip(names, reqs, strict=True)]
    assert texts == want
    assert len(set(texts[:3])) == 3
    assert len(engine.batched.scheduler.prefix_cache) == 3


def test_more_adapters_than_slots_evict_the_least_recently_used(
    tiny: LoadedModel, adapter_dir: Path, images: list[PreparedImage]
) -> None:
    names = ["alpha", "beta", "gamma", "delta@12", "alpha", None, "gamma"]
    reqs = _requests(images, names)
    *texts, engine = _run(tiny, adapter_dir, reqs, max_adapters=2)
    refs = {n: _reference(tiny, adapter_dir, n) for n in set(names)}
    for req, text in zip(reqs, texts, strict=True):
        assert text == _want(refs[req.adapter], req), (req.request_id, req.adapter)
    slots = engine.batched.adapters.slots
    assert slots.evictions >= 2 and slots.pins == [0, 0]


@pytest.mark.parametrize("bound", ["adapter_wait_s", "deadline"])
def test_a_request_that_waits_too_long_for_a_slot_is_refused(
    tiny: LoadedModel, adapter_dir: Path, images: list[PreparedImage], bound: str
) -> None:
    """One slot, pinned by a long request: a request for another adapter waits, then is
    refused: RESOURCE_EXHAUSTED past adapter_wait_s, DEADLINE_EXCEEDED past its deadline."""
    long = GenerationRequest(
        Task.CAPTION, images[0], temperature=0, max_tokens=200, adapter="alpha"
    )

    pinned_at_refusal: list[bool] = []

    async def run() -> BaseException | str:
        cfg = EngineConfig(
            max_batch_size=4,
            kv_budget_bytes=32 << 20,
            adapters_dir=str(adapter_dir),
            max_adapter_rank=RANK,
            max_adapters=1,
            adapter_wait_s=0.05 if bound == "adapter_wait_s" else 30,
        )
        engine = InProcessEngine(BatchedEngine(tiny, cfg))
        await engine.start()
        try:
            stream = await engine.submit(long)
            deadline = time.monotonic() + 0.05 if bound == "deadline" else None
            late = GenerationRequest(
                Task.CAPTION, images[0], max_tokens=4, adapter="beta", deadline=deadline
            )
            try:
                return await _text(engine, late)
            except EngineError as err:
                # The long request still holds the slot: the refusal came from the bound, not
                # from a wait that outlasted it (200 tokens end long before the 30 s default).
                adapters = engine.batched.adapters
                assert adapters is not None
                pinned_at_refusal.append(any(adapters.slots.pins))
                return err
            finally:
                stream.cancel()
        finally:
            await engine.close()

    err = asyncio.run(run())
    assert isinstance(err, EngineError) and err.field == "adapter"
    assert pinned_at_refusal == [True]
    if bound == "deadline":
        assert err.code is ErrorCode.DEADLINE_EXCEEDED
    else:
        assert err.code is ErrorCode.RESOURCE_EXHAUSTED and "max_adapters" in err.message


@pytest.mark.parametrize(
    ("name", "code", "words"),
    [
        ("missing", ErrorCode.INVALID_ARGUMENT, "not in the adapter folder"),
        ("broken", ErrorCode.INVALID_ARGUMENT, "cannot read"),
        ("wide", ErrorCode.INVALID_ARGUMENT, "max_adapter_rank"),
        ("shapes", ErrorCode.INVALID_ARGUMENT, "text.blocks.1.mlp.fc2"),
        ("../etc", ErrorCode.INVALID_ARGUMENT, "not a name"),
    ],
)
def test_bad_adapters_are_refused_naming_the_field(
    tiny: LoadedModel,
    tmp_path: Path,
    images: list[PreparedImage],
    name: str,
    code: ErrorCode,
    words: str,
) -> None:
    targets = tiny.model.text.lora_targets
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    write_random(tmp_path, "wide", targets, rank=RANK + 1)
    state = torch.load(write_random(tmp_path, "shapes", targets, rank=2), weights_only=True)
    key = "text_model.transformer.h.1.mlp.fc2.parametrizations.weight.0.A"
    state[key] = state[key][:, :-1]
    torch.save(state, tmp_path / "shapes" / "final.pt")
    req = GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=4, adapter=name)
    err, _ = _run(tiny, tmp_path, [req])
    assert isinstance(err, EngineError), err
    assert err.code is code and err.field == "adapter"
    assert words in err.message


def test_a_server_without_adapters_refuses_one(
    tiny: LoadedModel, images: list[PreparedImage]
) -> None:
    req = GenerationRequest(Task.CAPTION, images[0], max_tokens=4, adapter="alpha")
    err, engine = _run(tiny, Path("."), [req], adapters_dir=None)
    assert isinstance(err, EngineError) and err.field == "adapter"
    assert engine.batched.runtime.adapters is None


def test_vlm_run_answers_with_an_adapter_file(
    tiny: LoadedModel,
    tiny_dir: Path,
    adapter_dir: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    from vlm_server.cli import main as cli_main

    base = ["--model", str(tiny_dir), "--device", "cpu", "--temperature", "0", "--json"]
    path = adapter_dir / "alpha" / "final.pt"
    assert (
        cli_main(["run", "caption", "sample", "--max-tokens", "8", *base, "--adapter", str(path)])
        == 0
    )
    got = json.loads(capsys.readouterr().out)["text"]
    want = _reference(tiny, adapter_dir, "alpha").caption(
        prepare_image(sample_image_bytes()), "normal", SamplingSettings(0, max_tokens=8)
    )
    assert got == want.text
    bad = adapter_dir / "nowhere.pt"
    assert cli_main(["run", "caption", "sample", *base, "--adapter", str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_steps_without_adapter_rows_run_no_lora(
    tiny: LoadedModel,
    adapter_dir: Path,
    images: list[PreparedImage],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With adapters on, base-model requests alone run the plain forwards (on CUDA: the graphs
    captured without LoRA); a request with an adapter brings the deltas back."""
    from vlm_server.engine.device.adapter_rows import AdapterRows

    calls: list[int] = []
    for_rows = AdapterRows.for_rows

    def counted(self: AdapterRows, rows: torch.Tensor) -> object:
        calls.append(len(rows))
        return for_rows(self, rows)

    monkeypatch.setattr(AdapterRows, "for_rows", counted)
    base = _requests(images, [None, None])
    *texts, _ = _run(tiny, adapter_dir, base)
    plain = _reference(tiny, adapter_dir, None)
    assert texts == [_want(plain, r) for r in base]
    assert not calls
    *_, _ = _run(tiny, adapter_dir, _requests(images, [None, "alpha"]))
    assert calls


@pytest.mark.parametrize("depth", [1, 2])
def test_reasoning_and_spatial_refs_with_adapters(
    tiny: LoadedModel, adapter_dir: Path, images: list[PreparedImage], depth: int
) -> None:
    """The three features together: reasoning queries and queries with spatial references,
    each with an adapter or none, in one batch; each equals the reference with its adapter."""
    refs = ((0.25, 0.75), (0.1, 0.2, 0.6, 0.9))
    names = ["alpha", None, "beta", "alpha"]
    reqs = [
        GenerationRequest(
            Task.QUERY,
            images[i % 2],
            request_id=f"x{i}",
            question="what is here",
            temperature=0,
            max_tokens=10,
            adapter=name,
            reasoning=i < 2,
            spatial_refs=refs if i % 2 else (),
        )
        for i, name in enumerate(names)
    ]
    *texts, _ = _run(tiny, adapter_dir, reqs, pipeline_depth=depth)
    for req, text in zip(reqs, texts, strict=True):
        ref = _reference(tiny, adapter_dir, req.adapter)
        s = SamplingSettings(temperature=0, max_tokens=req.max_tokens)
        if req.reasoning:
            want = ref.reasoning_query(req.image, req.question, s, req.spatial_refs).answer
        else:
            _, _, out = ref.run(req)
            want = ref.tokenizer.decode(out)
        assert text == want, req.request_id
