"""The reference generation: every task, sampling reproducibility, caps and context limits."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from image_pipeline import PreparedImage
from vlm_server.cli import main as cli_main
from vlm_server.models import prompts
from vlm_server.models.interface import LoadedModel
from vlm_server.models.kv import DenseKVCache
from vlm_server.models.registry import load_model, preset, write_checkpoint
from vlm_server.reference import ContextOverflow, ReferenceGenerator, SamplingSettings

GREEDY = SamplingSettings(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def generator(tiny: LoadedModel) -> ReferenceGenerator:
    """The plain reference, not the suite's shared one that remembers its answers: these
    tests check the reference itself (a second call with a seed must sample it again)."""
    return ReferenceGenerator(tiny.model, tiny.tokenizer)


def test_caption_lengths_use_their_templates(
    generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    texts = {}
    for length in ("short", "normal", "long"):
        r = generator.caption(sample_image, length, GREEDY)
        assert r.finish_reason in ("eos", "length")
        assert 0 < len(r.token_ids) <= 24 or r.finish_reason == "eos"
        assert generator.contract.eos_id not in r.token_ids
        assert r.text == generator.tokenizer.decode(r.token_ids)
        texts[length] = r.token_ids
    # The templates differ in one token; that must reach the first step's logits.
    logits = []
    for length in ("short", "normal", "long"):
        _, hidden, _ = generator._start(
            sample_image, prompts.caption_prompt(generator.contract, length), 1
        )
        logits.append(generator.model.text.logits(hidden))
    assert not torch.allclose(logits[0], logits[1]) and not torch.allclose(logits[1], logits[2])


def test_greedy_decode_equals_full_recompute(
    generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    """The cached step-by-step decode gives the argmax of a from-scratch forward each step."""
    m = generator.model
    r = generator.query(sample_image, "what is here?", GREEDY)
    prompt = prompts.query_prompt(
        generator.contract, lambda s: generator.tokenizer.encode(s).ids, "what is here?"
    )
    crops = sample_image.normalized(m.dtype, m.device)
    prefix = m.prefix_embeddings(m.image_embeddings(crops, sample_image.tiling))
    ids = torch.tensor(prompt + r.token_ids)[None]
    x = torch.cat([prefix, m.text.embed(ids)], 1)
    n = x.shape[1]
    cache = DenseKVCache(
        m.kv_shape, m.config.text.max_context, 1, m.dtype, m.device, prefix.shape[1]
    )
    logits = m.text.logits(m.text(x, torch.arange(n)[None], cache))[0]
    start = prefix.shape[1] + len(prompt) - 1
    want = []
    for i in range(len(r.token_ids)):
        row = logits[start + i].clone()
        if i:
            row[list(generator.contract.decode_suppressed_ids)] = float("-inf")
        want.append(int(row.argmax()))
    assert want == r.token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(
    generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    s = SamplingSettings(temperature=1.0, top_p=0.95, max_tokens=16, seed=7)
    a = generator.caption(sample_image, "normal", s)
    b = generator.caption(sample_image, "normal", s)
    others = [
        generator.caption(
            sample_image,
            "normal",
            SamplingSettings(temperature=1.0, top_p=0.95, max_tokens=16, seed=seed),
        ).token_ids
        for seed in (8, 9, 10)
    ]
    assert a.token_ids == b.token_ids
    assert any(o != a.token_ids for o in others)


def test_suppressed_ids_never_appear_after_the_first_token(
    generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    model = copy.deepcopy(generator.model)
    answer = generator.contract.answer_id
    with torch.no_grad():
        model.text.lm_head.bias[answer] += 1e4
    gen = ReferenceGenerator(model, generator.tokenizer)
    r = gen.caption(sample_image, "short", SamplingSettings(temperature=0, max_tokens=5))
    assert r.token_ids[0] == answer and answer not in r.token_ids[1:]


def test_text_only_query_has_no_image_prefix(generator: ReferenceGenerator) -> None:
    r = generator.query(None, "hello there", GREEDY)
    assert r.finish_reason in ("eos", "length")
    assert r.text == generator.tokenizer.decode(r.token_ids)


def _biased(generator: ReferenceGenerator, token: int) -> ReferenceGenerator:
    model = copy.deepcopy(generator.model)
    with torch.no_grad():
        model.text.lm_head.bias[token] += 1e4
    return ReferenceGenerator(model, generator.tokenizer)


@pytest.mark.parametrize("task", ["point", "detect"])
def test_regions_hit_max_objects_and_stay_normalized(
    generator: ReferenceGenerator, sample_image: PreparedImage, task: str
) -> None:
    gen = _biased(generator, generator.contract.coord_id)
    r = getattr(gen, task)(sample_image, "car", max_objects=4)
    assert r.finish_reason == "max_objects"
    items = r.points if task == "point" else r.boxes
    assert len(items) == 4
    for it in r.points:
        assert 0 <= it.x < 1 and 0 <= it.y < 1
    for b in r.boxes:
        assert b.x_min <= b.x_max and b.y_min <= b.y_max
        cx, w = (b.x_min + b.x_max) / 2, b.x_max - b.x_min
        assert 0 <= cx < 1 and 2**-10 - 1e-9 <= w <= 1 + 1e-9  # log-scale size range


@pytest.mark.parametrize("task", ["point", "detect"])
def test_regions_stop_at_eos(
    generator: ReferenceGenerator, sample_image: PreparedImage, task: str
) -> None:
    gen = _biased(generator, generator.contract.eos_id)
    r = getattr(gen, task)(sample_image, "car")
    assert r.finish_reason == "eos" and not r.points and not r.boxes


def test_boundary_weighs_the_whole_vocabulary(
    generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    # eos outscores coord, but a third token outscores both: the reference continues.
    eos, coord = generator.contract.eos_id, generator.contract.coord_id
    logits = torch.zeros(1, generator.config.text.vocab_size)
    logits[0, 42], logits[0, eos], logits[0, coord] = 10, 5, 1
    assert generator.boundary_token(logits) == 42
    model = copy.deepcopy(generator.model)
    with torch.no_grad():
        bias = model.text.lm_head.bias
        bias[eos] = bias.max() + 1e3
        bias[42] = bias[eos] + 1e3
    gen = ReferenceGenerator(model, generator.tokenizer)
    for task, items in (("point", "points"), ("detect", "boxes")):
        r = getattr(gen, task)(sample_image, "car", max_objects=3)
        assert r.finish_reason == "max_objects" and len(getattr(r, items)) == 3


def test_gpt2_contract_tests_only_eos(tmp_path: Path, sample_image: PreparedImage) -> None:
    out = write_checkpoint(preset("tiny-gpt2"), tmp_path, seed=1, progress=False)
    loaded = load_model(out, dtype=torch.float32, progress=False)
    gen = ReferenceGenerator(loaded.model, loaded.tokenizer)
    logits = torch.zeros(1, 51200)
    logits[0, 42] = 1
    assert gen.boundary_token(logits) == 42  # anything but eos starts an object
    prompt = prompts.detect_prompt(gen.contract, lambda s: gen.tokenizer.encode(s).ids, "car")
    assert prompt[:4] == [198, 198, 47504, 25] and prompt[-1] == 628
    r = _biased(gen, 42).point(sample_image, "car", max_objects=3)
    assert len(r.points) == 3
    r = gen.caption(sample_image, "short", GREEDY)
    assert 50256 not in r.token_ids


def test_context_overflow_is_refused(
    generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    with pytest.raises(ContextOverflow, match="exceeds the model context"):
        generator.caption(sample_image, "short", SamplingSettings(max_tokens=2000))
    with pytest.raises(ContextOverflow):
        generator.detect(sample_image, "car", max_objects=500)


def test_invalid_settings_are_refused() -> None:
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingSettings(**bad)


def test_cli_runs_each_task_on_the_sample(
    tiny_dir: Path, capsys: pytest.CaptureFixture, tiny: LoadedModel
) -> None:
    base = ["--model", str(tiny_dir), "--device", "cpu", "--dtype", "fp32"]
    assert cli_main(["run", "detect", "sample", "car", "--json", *base]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["task"] == "detect" and isinstance(out["boxes"], list)
    assert cli_main(["run", "caption", "sample", "--max-tokens", "5", "--json", *base]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] in ("eos", "length") and isinstance(out["text"], str)
    assert cli_main(["run", "point", "sample", "dog", *base]) == 0
    assert "points" in capsys.readouterr().out
    assert cli_main(["run", "query", "sample", *base]) == 2  # no question
    assert cli_main(["run", "query", str(tiny_dir / "config.json"), "hi", *base]) == 1
    assert "error" in capsys.readouterr().err


def test_cli_default_model_is_written_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli_main(["run", "caption", "sample", "--max-tokens", "3", "--device", "cpu"]) == 0
    assert "random" in capsys.readouterr().err
    written = list((tmp_path / "moondream-serve" / "models").iterdir())
    assert [p.name for p in written] == ["tiny-seed0-words-v2"]
    assert cli_main(["make-checkpoint", str(tmp_path / "ck"), "--preset", "tiny"]) == 0
    assert (tmp_path / "ck" / "model.safetensors").exists()


def test_reference_segment_and_constraints_parse(
    generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    seg, reason = generator.segment(sample_image, "car", max_tokens=30)
    assert reason in ("eos", "length")
    assert seg.path.startswith("M") and seg.path.endswith("Z")
    assert seg.mask_size == (sample_image.height, sample_image.width)
    assert sum(seg.mask_counts) == sample_image.height * sample_image.width
    x0, y0, x1, y1 = seg.box
    assert x0 <= x1 and y0 <= y1
    for seed in range(5):
        s = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=10, seed=seed)
        r = generator.query(sample_image, "which?", s, choices=("yes", "no", "maybe not"))
        assert r.text in ("yes", "no", "maybe not") and r.finish_reason == "eos"
        r = generator.query(None, "digits", s, regex=r"[0-9]{2,4}")
        assert re.fullmatch(r"[0-9]{2,4}", r.text)


def test_cached_encoder_gives_the_tokenizers_ids_and_encodes_each_text_once(
    generator: ReferenceGenerator,
) -> None:
    tok = generator.tokenizer
    calls: list[str] = []

    class Counting:
        def encode(self, text: str) -> object:
            calls.append(text)
            return tok.encode(text)

    encode = prompts.CachedEncoder(Counting(), entries=2)  # type: ignore[arg-type]
    for text in ["a dog", " what is here?", "a dog", "a dog"]:
        assert encode(text) == tuple(tok.encode(text).ids)
    assert calls == ["a dog", " what is here?"]
    encode("x"), encode("y"), encode("a dog")  # two entries: the oldest went
    assert calls[-1] == "a dog"
