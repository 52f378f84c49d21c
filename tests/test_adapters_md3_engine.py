"""Moondream 3 finetune adapters in the batched engine (the tiny expert model, CPU): token
equality with the reference generation (which computes each expert's deltas row by row), mixed
batches of no adapter and two adapters in one forward, image prefixes keyed by (image,
adapter), and errors naming the field."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from image_pipeline import PreparedImage, prepare_pil, sample_image
from tests.support.reference_memo import shared_reference
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)
from vlm_server.engine.api import EngineError, ErrorCode, Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.scheduler import Scheduler
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.models.lora import experts, files, formats
from vlm_server.models.lora.spec import AdapterWeights
from vlm_server.models.lora.writer import write_random_finetune
from vlm_server.models.registry import preset, random_model
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.server.in_process import InProcessEngine

RANK = 6  # md3-tiny: 3 experts per token, rank 2 each
NAMES = {"ft-a@10": (RANK, 0.3), "ft-b@20": (3, 0.5), "ft-c@5": (RANK, 0.4)}


@pytest.fixture(scope="module")
def md3_tiny() -> LoadedModel:
    return random_model(preset("md3-tiny"), seed=1, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def adapter_dir(md3_tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("finetunes")
    targets = md3_tiny.model.text.lora_targets
    for i, (name, (rank, scale)) in enumerate(NAMES.items()):
        # Large enough to change answers, small enough to keep them varied.
        write_random_finetune(folder, name, targets, rank=rank, seed=20 + i, scale=scale)
    return folder


@pytest.fixture(scope="module")
def images() -> list[PreparedImage]:
    base = sample_image()
    return [prepare_pil(base), prepare_pil(base.rotate(90, expand=True))]


_WANT: dict[tuple, str] = {}  # the reference is slow on the CPU: each answer computed once


def _want(loaded: LoadedModel, folder: Path, req: GenerationRequest) -> str:
    key = (req.adapter, req.task, req.image.content_hash, req.max_tokens)
    if key not in _WANT:
        weights = None
        if req.adapter is not None:
            path = files.find(folder, req.adapter)
            assert path is not None
            weights = formats.load(path, loaded.model.text.lora_targets, RANK, req.adapter)
        ref = ReferenceGenerator(loaded.model, loaded.tokenizer, weights)
        s = SamplingSettings(temperature=0, max_tokens=req.max_tokens)
        if req.task is Task.CAPTION:
            _WANT[key] = ref.caption(req.image, req.caption_length, s).text
        else:
            _WANT[key] = ref.query(req.image, req.question, s).text
    return _WANT[key]


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
    return [
        GenerationRequest(
            Task.CAPTION if i % 2 == 0 else Task.QUERY,
            images[i % len(images)],
            request_id=f"r{i}",
            question="what is this?",
            temperature=0,
            max_tokens=10,
            adapter=name,
        )
        for i, name in enumerate(names)
    ]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_finetune_request_equals_the_reference(
    md3_tiny: LoadedModel, adapter_dir: Path, images: list[PreparedImage], depth: int
) -> None:
    reqs = _requests(images[:1], ["ft-a@10"])
    *texts, _ = _run(md3_tiny, adapter_dir, reqs, pipeline_depth=depth)
    base = GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=10)
    assert texts[0] == _want(md3_tiny, adapter_dir, reqs[0])
    assert texts[0] != _want(md3_tiny, adapter_dir, base)  # the adapter changes the answer


# default: prompts ride their image's prefix batch; chunked: prompts split over mixed steps
# beside decode rows, none riding.
BUDGETS = {"default": {}, "chunked": {"max_step_tokens": 11, "prefix_prompt_tokens": 0}}


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("depth", [1, 2])
def test_a_mixed_batch_equals_each_request_alone(
    md3_tiny: LoadedModel,
    adapter_dir: Path,
    images: list[PreparedImage],
    depth: int,
    budget: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows without an adapter and with two finetunes (of ranks 6 and 3) share forwards
    (decode steps, mixed steps, prefix batches) and their expert layers; each answer is the
    reference's for its adapter alone."""
    seen: list[set[int]] = []
    delta = experts.ExpertLoraBank.expert_delta

    def watched(self, index, *args):  # type: ignore[no-untyped-def]
        seen.append(set(index.tolist()))
        return delta(self, index, *args)

    monkeypatch.setattr(experts.ExpertLoraBank, "expert_delta", watched)
    names = [None, "ft-a@10", "ft-b@20", None, "ft-b@20", "ft-a@10"]
    reqs = _requests(images, names)
    # Nothing is admitted before every request waits (the finetunes' loads finish at their own
    # pace): then the first forwards hold all three adapters whatever the timing.
    # (Bounded at a minute: a request that never arrives fails the test instead of hanging it.)
    tick, spins = Scheduler.tick, [0]

    def gated(self: Scheduler) -> None:
        if spins[0] >= 0 and len(self.waiting) < len(reqs) and spins[0] < 60_000:
            spins[0] += 1
            time.sleep(0.001)  # the engine's thread, waiting for the finetunes' loads
            return
        spins[0] = -1
        tick(self)

    monkeypatch.setattr(Scheduler, "tick", gated)
    *texts, engine = _run(md3_tiny, adapter_dir, reqs, pipeline_depth=depth, **BUDGETS[budget])
    for req, text in zip(reqs, texts, strict=True):
        assert text == _want(md3_tiny, adapter_dir, req), (req.request_id, req.adapter)
    assert texts[1] != texts[3] and texts[2] != texts[0]  # same request, another adapter
    assert engine.batched.adapters.slots.pins == [0] * engine.batched.cfg.max_adapters
    assert max(len(slots) for slots in seen) >= 3  # none and two finetunes in one forward


def test_image_prefixes_are_keyed_by_image_and_adapter(
    md3_tiny: LoadedModel, adapter_dir: Path, images: list[PreparedImage]
) -> None:
    """The same image with two finetunes (and none): three prefixes, three answers, each the
    reference's; a repeat of one hits its own prefix."""
    names = ["ft-a@10", "ft-c@5", None, "ft-a@10"]
    reqs = [
        GenerationRequest(Task.CAPTION, images[1], temperature=0, max_tokens=10, adapter=n)
        for n in names
    ]
    *texts, engine = _run(md3_tiny, adapter_dir, reqs)
    assert texts == [_want(md3_tiny, adapter_dir, r) for r in reqs]
    assert len(set(texts[:3])) == 3
    assert len(engine.batched.scheduler.prefix_cache) == 3


def test_steps_without_finetune_rows_run_no_lora(
    md3_tiny: LoadedModel,
    adapter_dir: Path,
    images: list[PreparedImage],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adapters on, base-model requests only: the plain forwards, never an expert delta, and
    the base model's answers."""
    calls: list[int] = []
    delta = experts.ExpertLoraBank.expert_delta

    def counted(self, *args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return delta(self, *args)

    monkeypatch.setattr(experts.ExpertLoraBank, "expert_delta", counted)
    base = _requests(images, [None, None])
    *texts, engine = _run(md3_tiny, adapter_dir, base)
    assert isinstance(engine.batched.runtime.adapter_bank, experts.ExpertLoraBank)
    assert texts == [_want(md3_tiny, adapter_dir, r) for r in base]
    assert not calls


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("missing@1", "not in the adapter folder"),
        ("wide@1", "max_adapter_rank is 6"),
        ("odd@1", "rank 4 is not divisible by the 3 experts per token"),
        ("shapes@1", "'text_lora.moe.1.down_b' has shape (8, 64, 1)"),
    ],
)
def test_bad_finetunes_are_refused_naming_the_field(
    md3_tiny: LoadedModel,
    tmp_path: Path,
    images: list[PreparedImage],
    name: str,
    words: str,
) -> None:
    targets = md3_tiny.model.text.lora_targets
    write_random_finetune(tmp_path, "wide@1", targets, rank=RANK + 3)
    path = write_random_finetune(tmp_path, "odd@1", targets, rank=3)
    state = torch.load(path, weights_only=True)
    state["lora_state_dict"]["text_lora.dense.0.up_a"] = torch.zeros(4, 64)
    torch.save(state, path)
    path = write_random_finetune(tmp_path, "shapes@1", targets, rank=RANK)
    state = torch.load(path, weights_only=True)
    key = "text_lora.moe.1.down_b"
    state["lora_state_dict"][key] = state["lora_state_dict"][key][..., :1]
    torch.save(state, path)
    req = GenerationRequest(Task.CAPTION, images[0], temperature=0, max_tokens=4, adapter=name)
    err, _ = _run(md3_tiny, tmp_path, [req])
    assert isinstance(err, EngineError), err
    assert err.code is ErrorCode.INVALID_ARGUMENT and err.field == "adapter"
    assert words in err.message


@pytest.mark.parametrize("depth", [1, 2])
def test_reasoning_and_spatial_refs_with_finetunes(
    md3_tiny: LoadedModel, adapter_dir: Path, images: list[PreparedImage], depth: int
) -> None:
    """Reasoning queries and queries with spatial references, each with a finetune or none,
    in one batch; each equals the reference with its adapter."""
    refs = ((0.25, 0.75), (0.1, 0.2, 0.6, 0.9))
    names = ["ft-a@10", None, "ft-b@20", "ft-a@10"]
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
    *texts, _ = _run(md3_tiny, adapter_dir, reqs, pipeline_depth=depth)
    targets = md3_tiny.model.text.lora_targets
    for req, text in zip(reqs, texts, strict=True):

        def weights(name: str | None = req.adapter) -> AdapterWeights | None:
            if name is None:
                return None
            path = files.find(adapter_dir, name)
            assert path is not None
            return formats.load(path, targets, RANK, name)

        ref = shared_reference(
            md3_tiny.model, md3_tiny.tokenizer, weights, adapter_key=(adapter_dir, req.adapter)
        )
        s = SamplingSettings(temperature=0, max_tokens=req.max_tokens)
        if req.reasoning:
            want = ref.reasoning_query(req.image, req.question, s, req.spatial_refs).answer
        else:
            _, _, out = ref.run(req)
            want = ref.tokenizer.decode(out)
        assert text == want, req.request_id


def test_the_adapter_benchmark_runs_finetunes(tmp_path: Path) -> None:
    """bench/lora_bench.py on the tiny expert model writes Moondream 3 finetunes and measures."""
    import json

    from bench import lora_bench

    lora_bench.main(
        [
            "--preset", "md3-tiny", "--dtype", "fp32", "--streams", "3", "--tokens", "10",
            "--adapters", "2", "--rank", "6", "--load-streams", "2", "--load-tokens", "100",
            "--loads", "1", "--warmup", "0.3", "--kv-gib", "0.05", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    d = json.loads((tmp_path / "lora_bench.json").read_text())
    assert d["preset"] == "md3-tiny" and set(d["period"]) == {"off", "none", "lora"}
    assert all(c["period_ms"] > 0 for c in d["period"].values())


def test_vlm_run_answers_with_a_finetune_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``vlm run --adapter`` reads a Moondream 3 checkpoint in the cloud's format."""
    import json

    from image_pipeline import prepare_image, sample_image_bytes
    from vlm_server.cli import main as cli_main
    from vlm_server.models.registry import load_model, write_checkpoint

    model_dir = write_checkpoint(preset("md3-tiny"), tmp_path / "md3", seed=2, progress=False)
    loaded = load_model(model_dir, dtype=torch.float32, progress=False)
    targets = loaded.model.text.lora_targets
    path = write_random_finetune(tmp_path, "ft@3", targets, rank=RANK, seed=5, scale=0.4)
    base = ["--model", str(model_dir), "--device", "cpu", "--temperature", "0", "--json"]
    args = ["run", "caption", "sample", "--max-tokens", "8", *base, "--adapter", str(path)]
    assert cli_main(args) == 0
    got = json.loads(capsys.readouterr().out)["text"]
    weights = formats.load(path, targets, RANK, "ft@3")
    image = prepare_image(sample_image_bytes())
    settings = SamplingSettings(0, max_tokens=8)
    assert (
        got
        == ReferenceGenerator(loaded.model, loaded.tokenizer, weights)
        .caption(image, "normal", settings)
        .text
    )
    plain = ReferenceGenerator(loaded.model, loaded.tokenizer).caption(image, "normal", settings)
    assert got != plain.text


def test_a_packed_transfer_stages_what_the_weights_stage(
    md3_tiny: LoadedModel, adapter_dir: Path
) -> None:
    """The adapter reader's child packs a finetune in the bank's transfer layout; staging
    from that equals staging from the weights (dense slot and every expert pair)."""
    targets = md3_tiny.model.text.lora_targets
    bank = experts.ExpertLoraBank(targets, 2, RANK, torch.float32, "cpu")
    path = files.find(adapter_dir, "ft-b@20")
    assert path is not None
    weights = formats.load(path, targets, RANK, "ft-b@20")
    want = {k: (v.clone() if isinstance(v, torch.Tensor) else tuple(x.clone() for x in v))
            for k, v in bank.staging(weights).items()}  # fmt: skip
    flat = torch.full((bank.transfer.numel,), float("nan"))
    bank.transfer.pack(weights, flat)
    got = bank.staging_from(flat)
    assert set(got) == set(want) and len(want) > 1
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert all(torch.equal(g, w) for g, w in zip(got[key], value, strict=True)), key


def test_the_engine_process_parses_no_finetune_file(
    md3_tiny: LoadedModel,
    adapter_dir: Path,
    images: list[PreparedImage],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child process reads Moondream 3 finetunes too: parsing fails in this process, and
    the engine still answers as the reference does with the adapter."""
    reqs = _requests(images[:1], ["ft-c@5"])
    want = _want(md3_tiny, adapter_dir, reqs[0])  # the reference reads the file here first

    def parse_here(*args: object, **kw: object) -> None:
        raise AssertionError("the engine process parsed an adapter file")

    monkeypatch.setattr(formats, "load", parse_here)
    monkeypatch.setattr(torch, "load", parse_here)
    *texts, _ = _run(md3_tiny, adapter_dir, reqs)
    assert texts[0] == want
