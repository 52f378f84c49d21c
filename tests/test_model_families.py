"""The model-family seam: a second family (tests/support/toy_family.py, another decoder, vision
path, region heads and checkpoint format), added as one line of the families table, is served
by the unchanged engine and both doors, answering as the reference generation does on the same
model; what it lacks is refused at start naming the flag."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from image_pipeline import prepare_image, sample_image_bytes
from tests.http_support import post_json
from tests.support.service_harness import ServerThread, in_process, local_config
from tests.support.toy_family import FAMILY as TOY
from tests.support.toy_family import ToyConfig
from vlm_server.client import VisionLanguageClient
from vlm_server.models import capabilities, families, quantized, registry
from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.server.engines import batched_engine

GREEDY = SamplingSettings(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def toy_family() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:  # the one line a shipped family adds
        patch.setitem(families.FAMILIES, "toy", "tests.support.toy_family")
        yield


@pytest.fixture(scope="module")
def toy_dir(toy_family: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return registry.write_checkpoint(registry.preset("toy"), tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def toy(toy_dir: Path) -> LoadedModel:
    return registry.load_model(toy_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def toy_server(toy_dir: Path) -> Iterator[ServerThread]:
    """What ``vlm serve --model <toy checkpoint>`` runs: the service loads it by its config."""
    config = local_config(model=str(toy_dir), device="cpu", dtype="fp32", http_port=-1)
    with ServerThread(config, in_process(lambda: batched_engine(config))) as running:
        yield running


def test_the_registry_resolves_presets_configs_and_checkpoints_to_their_family(
    toy_family: None, toy_dir: Path, toy: LoadedModel
) -> None:
    assert {"toy", "tiny", "moondream2"} <= set(registry.preset_names())
    assert registry.family_for_preset("toy") is TOY
    assert registry.family_of(registry.preset("tiny")).name == "moondream2"
    assert isinstance(toy.config, ToyConfig) and toy.source == str(toy_dir)
    with pytest.raises(ValueError, match=r"unknown preset 'nope'.*toy"):
        registry.preset("nope")
    (toy_dir.parent / "refiner.pt").write_bytes(b"")  # the model declares no refiner
    with pytest.raises(ValueError, match=r"--segment-refiner: the model 'toy' has no segm"):
        registry.segment_refiner(toy, toy_dir.parent / "refiner.pt")


class _Clash:
    name = "clash"
    presets: ClassVar[dict[str, type]] = {"toy": ToyConfig}


FAMILY = _Clash()  # what the table's line for "clash" names


def test_a_family_whose_presets_clash_is_refused(
    toy_family: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(families.FAMILIES, "clash", __name__)
    with pytest.raises(ValueError, match=r"family 'clash': presets \['toy'\] are taken"):
        registry.preset_names()


def test_flags_asking_for_what_the_family_lacks_are_refused_at_start_naming_each(
    toy: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's check after loading (server/engines.py), and the engine's (ModelRuntime)."""
    from vlm_server.engine.config import EngineConfig
    from vlm_server.engine.engine import BatchedEngine

    asked = {"vision_fp8": True, "adapters_dir": str(tmp_path), "fused_decode": True}
    with pytest.raises(capabilities.CapabilityError) as err:
        capabilities.check(toy.model, asked)
    assert str(err.value) == (
        "--vision-fp8: the model 'toy' has no FP8 vision tower; "
        "--adapters-dir: the model 'toy' has no finetune adapters"
    )
    capabilities.check(toy.model, {"fused_decode": True})  # preferred where offered: no error
    for value in ("auto", "off", None, False):  # an auto switch asks for nothing
        capabilities.check(toy.model, {"experts_fp8_activations": value})
    with pytest.raises(capabilities.CapabilityError, match="--experts-fp8-activations"):
        capabilities.check(toy.model, {"experts_fp8_activations": "on"})
    with pytest.raises(capabilities.CapabilityError, match="--experts-fp8-activations"):
        BatchedEngine(toy, EngineConfig(experts_fp8_activations=True))
    monkeypatch.setattr(TOY, "formats", dataclasses.replace(TOY.formats, weights=("fp32",)))
    with pytest.raises(capabilities.CapabilityError, match="--dtype fp16: the toy family"):
        registry.random_model(toy.config, dtype=torch.float16, progress=False)


def test_every_family_declares_its_formats_alike_before_and_after_loading(
    toy_family: None,
) -> None:
    for fam in registry.families():
        smallest = min(fam.presets, key=len)  # tiny, md3-tiny, toy
        config = fam.presets[smallest]()
        model = fam.random_model(
            config, seed=0, dtype=torch.float32, device="cpu", progress=False
        ).model
        assert model.capabilities.formats == fam.formats, fam.name


def test_a_checkpoint_no_family_reads_is_refused_naming_the_presets(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"format": "someone-else/9"}')
    with pytest.raises(CheckpointError, match=r"no model family reads .*name a preset"):
        registry.load_model(tmp_path)


def test_a_second_family_serves_every_task_over_grpc_as_the_reference_answers(
    toy: LoadedModel, toy_server: ServerThread
) -> None:
    ref = ReferenceGenerator(toy.model, toy.tokenizer)
    image = prepare_image(sample_image_bytes())
    with VisionLanguageClient(toy_server.target, timeout=60) as client:
        greedy = {"temperature": 0.0, "max_tokens": 8}
        got = client.caption(sample_image_bytes(), "normal", **greedy)
        assert got.text == ref.caption(image, "normal", GREEDY).text
        got = client.query(sample_image_bytes(), "what is here?", **greedy)
        assert got.text == ref.query(image, "what is here?", GREEDY).text
        events = list(client.query_stream(None, "tell me", **greedy))
        assert "".join(e.text for e in events[:-1]) == ref.query(None, "tell me", GREEDY).text
        points = client.point(sample_image_bytes(), "dog", max_objects=3)
        want = ref.point(image, "dog", max_objects=3)
        assert [(p.x, p.y) for p in points.points] == [(p.x, p.y) for p in want.points]
        boxes = client.detect(sample_image_bytes(), "dog", max_objects=3)
        want = ref.detect(image, "dog", max_objects=3)
        assert [(b.x_min, b.y_min, b.x_max, b.y_max) for b in boxes.boxes] == [
            (b.x_min, b.y_min, b.x_max, b.y_max) for b in want.boxes
        ]


def test_a_second_family_serves_moondreams_http_api_and_openai_chat(
    toy: LoadedModel, toy_server: ServerThread
) -> None:
    ref = ReferenceGenerator(toy.model, toy.tokenizer)
    image = prepare_image(sample_image_bytes())
    url = "data:image/jpeg;base64," + base64.b64encode(sample_image_bytes()).decode()
    settings = {"temperature": 0, "max_tokens": 8}
    status, body = post_json(
        f"{toy_server.http_url}/query",
        {"image_url": url, "question": "what is here?", "settings": settings},
    )
    assert status == 200, body
    assert body["answer"] == ref.query(image, "what is here?", GREEDY).text
    status, body = post_json(
        f"{toy_server.http_url}/detect",
        {"image_url": url, "object": "dog", "settings": {"max_objects": 3}},
    )
    assert status == 200, body
    want = ref.detect(image, "dog", max_objects=3)
    assert [tuple(o.values()) for o in body["objects"]] == [
        (b.x_min, b.y_min, b.x_max, b.y_max) for b in want.boxes
    ]
    status, body = post_json(
        f"{toy_server.http_url}/chat/completions",
        {
            "model": "toy",
            "messages": [{"role": "user", "content": "tell me"}],
            "temperature": 0,
            "max_tokens": 8,
        },
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == ref.query(None, "tell me", GREEDY).text


@pytest.mark.gpu
def test_a_family_without_fused_attention_is_refused_on_cuda_in_one_line(
    toy_family: None,
) -> None:
    from vlm_server.engine.config import EngineConfig
    from vlm_server.engine.engine import BatchedEngine

    loaded = registry.random_model(
        registry.preset("toy"), dtype=torch.bfloat16, device="cuda", progress=False
    )
    with pytest.raises(ValueError, match="no fused attention path"):
        BatchedEngine(loaded, EngineConfig(kv_budget_bytes=16 << 20))


def test_a_family_quantizes_the_weights_it_declares(
    toy_family: None, toy_dir: Path, tmp_path: Path
) -> None:
    """``vlm quantize`` takes its targets from the family (its own names), not Moondream's."""
    report = quantized.quantize_checkpoint(toy_dir, tmp_path / "int8", "int8", vision=True)
    assert report.family == "toy" and report.quantized
    assert all(n.startswith("text.blocks.") for n in report.quantized)
    assert any(n.endswith(".gate_up.weight") for n in report.quantized)
    file = quantized.load_quantized(tmp_path / "int8")
    assert file.quantized == sorted(report.quantized)
