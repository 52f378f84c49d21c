"""``--weights auto|fp8`` (engine/core/weights_choice.py, server/weights_start.py): the choice
as a decision table over models, cards and caps; a format that cannot hold the model refused
at start with the bytes it needs and the format that would fit; ``vlm plan`` saying what auto
would take; fp8 refused where the family or the chip has no FP8 experts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from vlm_server.chips import by_name
from vlm_server.cli import main
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.weights_choice import (
    WeightsError,
    choose_weights,
    fitting,
    least_bytes,
)
from vlm_server.models.capabilities import CapabilityError
from vlm_server.models.common import quant_gemm
from vlm_server.models.registry import memory_shape, preset, random_model, write_checkpoint
from vlm_server.options.table import ServerConfig
from vlm_server.server import weights_start
from vlm_server.server.weights_start import start_weights, stores_fp8

GIB = 1 << 30
MD2 = ("bf16", "int8", "int4")
MD3 = ("bf16", "int8", "fp8", "int4")
MD3_NO_FP8 = ("bf16", "int8", "int4")

# (model, card, --gpu-memory-bytes GiB, --max-batch-size, served) -> the format auto takes.
TABLE = [
    ("moondream2", "H100", None, 32, MD2, "bf16"),
    ("moondream2", "RTX 3060", None, 8, MD2, "bf16"),
    ("moondream2", "H100", 9, 16, MD2, "int8"),  # int8 needs 8.9 GiB, bf16 10.0
    ("moondream2", "H100", 7.9, 16, MD2, "int4"),  # int4 needs 8.3 GiB (with the context)
    ("moondream3", "H100", None, 32, MD3, "bf16"),
    # bf16 needs 28.6 GiB; int8 (experts included) is more exact than FP8 experts
    ("moondream3", "RTX 4090", None, 32, MD3, "int8"),
    ("moondream3", "H100", 16, 32, MD3, "int4"),
    ("moondream3", "RTX 3090", None, 32, MD3_NO_FP8, "int8"),
]


def _choose(model: str, card: str, cap: float | None, batch: int, served, asked="auto"):
    cfg = EngineConfig(
        gpu_memory_bytes=None if cap is None else int(cap * GIB), max_batch_size=batch
    )
    return choose_weights(
        memory_shape(preset(model)), cfg, by_name(card).memory_bytes, asked, served
    )


@pytest.mark.parametrize(("model", "card", "cap", "batch", "served", "chosen"), TABLE)
def test_auto_takes_the_most_exact_format_that_holds_the_batch(
    model: str, card: str, cap: float | None, batch: int, served, chosen: str
) -> None:
    choice = _choose(model, card, cap, batch, served)
    assert choice.weights == chosen
    assert choice.line.startswith(f"weights: {chosen} (auto): ")
    assert "\n" not in choice.line and "GiB" in choice.line
    cfg = EngineConfig(
        gpu_memory_bytes=None if cap is None else int(cap * GIB), max_batch_size=batch
    )
    shape = memory_shape(preset(model))
    plans = {w: fitting(shape, cfg, by_name(card).memory_bytes, w) for w in served}
    room = {w: p.needed_bytes <= p.context_bytes + p.limit_bytes for w, p in plans.items()}
    if room[chosen]:  # every more exact format lacked room
        more_exact = served[: served.index(chosen)]
        assert not any(room[w] for w in more_exact)
        if more_exact:
            assert f"{served[0]} needs" in choice.line
    else:  # nothing had room: the one with the most
        assert not any(room.values())
        assert plans[chosen].needed_bytes == min(p.needed_bytes for p in plans.values())
        assert "the rest wait in the queue" in choice.line


def test_a_cap_that_holds_no_format_fails_with_the_bytes() -> None:
    with pytest.raises(WeightsError, match=r"^--weights auto: no format holds the model") as err:
        _choose("moondream3", "H100", 4, 32, MD3)
    shape, cfg = memory_shape(preset("moondream3")), EngineConfig(gpu_memory_bytes=4 * GIB)
    need = least_bytes(fitting(shape, cfg, by_name("H100").memory_bytes, "int4"))
    assert f"the smallest, int4, needs {need} bytes" in str(err.value)


def test_an_asked_format_that_does_not_fit_names_the_one_that_would() -> None:
    with pytest.raises(WeightsError, match=r"^--weights bf16: the model needs \d+ bytes") as err:
        _choose("moondream3", "H100", 16, 32, MD3, asked="bf16")
    assert str(err.value).endswith("int8 would fit")
    with pytest.raises(WeightsError, match=r"no format fits$"):
        _choose("moondream3", "H100", 4, 32, MD3, asked="int4")
    ok = _choose("moondream3", "H100", 16, 32, MD3, asked="fp8")
    assert ok.weights == "fp8" and ok.line.startswith("weights: fp8: needs")


def _config_dir(tmp_path: Path, model: str) -> Path:
    """A checkpoint directory holding the config alone (the choice reads nothing else)."""
    folder = write_checkpoint(preset("tiny"), tmp_path / "tiny", progress=False)
    directory = tmp_path / model
    directory.mkdir()
    (directory / "config.json").write_text((folder / "config.json").read_text())
    return directory


def test_start_resolves_auto_before_reading_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = write_checkpoint(preset("tiny"), tmp_path / "tiny", progress=False)
    cpu = torch.device("cpu")
    assert start_weights(str(folder), None, "auto", EngineConfig(), cpu) is None
    assert start_weights(str(folder), None, "int8", EngineConfig(), cpu) == "int8"
    # A card of 1 GiB (faked: the choice reads the device's total memory, nothing else).
    monkeypatch.setattr(quant_gemm, "AVAILABLE", True)
    monkeypatch.setattr(
        weights_start.torch.cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(total_memory=GIB),
    )
    cuda = torch.device("cuda")
    with caplog.at_level("INFO", logger=weights_start.__name__):
        assert start_weights(str(folder), None, "auto", EngineConfig(), cuda) == "bf16"
    assert caplog.records[-1].getMessage().startswith("weights: bf16 (auto): needs ")
    tight = EngineConfig(gpu_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"^--weights auto: no format holds the model: .* bytes"):
        start_weights(str(folder), None, "auto", tight, cuda)


def test_fp8_is_refused_where_there_are_no_fp8_experts() -> None:
    with pytest.raises(CapabilityError, match=r"^--weights fp8: the moondream2 family serves"):
        random_model(preset("tiny"), dtype=torch.float32, progress=False, weights="fp8")
    with pytest.raises(CapabilityError, match=r"^--weights fp8: FP8 experts need a GPU"):
        random_model(preset("moondream3-tiny"), dtype=torch.float32, progress=False, weights="fp8")


def test_the_option_is_auto_by_default_and_names_its_field() -> None:
    assert ServerConfig().weights == "auto"
    with pytest.raises(ValueError, match=r"^weights must be one of auto, bf16, int8, int4, fp8"):
        ServerConfig(weights="int3")


def test_vlm_plan_says_what_auto_would_take(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--gpu", "RTX 4090", "--model", "md3"]
    main([*argv, "--json"])
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert auto["weights"] == "int8" and auto["line"].startswith("weights: int8 (auto)")
    main([*argv, "--weights", "auto", "--json"])
    assert json.loads(capsys.readouterr().out)["weights_format"] == "int8"
    main(argv)
    assert "weights: int8 (auto): bf16 needs" in capsys.readouterr().out


def test_a_checkpoint_of_fp8_experts_is_served_in_them_where_they_fit(tmp_path: Path) -> None:
    """Its FP8 values are the most exact there are for it: int8 would quantize them again,
    bf16 only widen them."""
    shape = memory_shape(preset("moondream3"))
    card = by_name("RTX 4090").memory_bytes
    choice = choose_weights(shape, EngineConfig(max_batch_size=32), card, "auto", MD3, own="fp8")
    assert choice.weights == "fp8" and choice.line.startswith("weights: fp8 (auto): needs")
    tight = EngineConfig(max_batch_size=32, gpu_memory_bytes=8 * GIB)
    assert choose_weights(shape, tight, card, "auto", MD3, own="fp8").weights == "int4"
    # The checkpoint's headers say so (weights_start reads nothing else).
    save_file({"w": torch.zeros(2, 2, dtype=torch.float8_e4m3fn)}, str(tmp_path / "a.safetensors"))
    save_file({"v": torch.zeros(2, dtype=torch.bfloat16)}, str(tmp_path / "b.safetensors"))
    assert stores_fp8(tmp_path) and stores_fp8(tmp_path / "a.safetensors")
    assert not stores_fp8(tmp_path / "b.safetensors")
