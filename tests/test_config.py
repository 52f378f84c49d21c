import dataclasses

import pytest
import torch

from vlm_server.models.moondream2.config import PRESETS, ModelConfig, TextConfig, preset
from vlm_server.models.moondream2.model import MoondreamModel


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips_through_dict(name: str) -> None:
    cfg = preset(name)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ValueError, match="tiny"):
        preset("nope")


@pytest.mark.parametrize("name", ["moondream2", "moondream2-2025-01-09", "moondream2-2025-04-14"])
def test_full_size_has_the_spec_tensor_and_parameter_counts(name: str) -> None:
    with torch.device("meta"):
        model = MoondreamModel(preset(name))
    state = model.state_dict()
    assert len(state) == 592
    assert sum(t.numel() for t in state.values()) == 1_927_237_104
    vision = sum(t.numel() for k, t in state.items() if k.startswith("vision."))
    region = sum(t.numel() for k, t in state.items() if k.startswith("region."))
    assert round(vision / 1e6, 1) == 448.6
    assert round(region / 1e6, 1) == 60.3


def test_contracts_differ_where_the_spec_says() -> None:
    new, old = preset("moondream2").tokens, preset("moondream2-2025-01-09").tokens
    assert (new.bos_id, new.eos_id, new.size_scale) == (0, 0, "log")
    assert (old.bos_id, old.eos_id, old.size_scale) == (50256, 50256, "linear")
    assert new.templates.caption("short") == (1, 32708, 2, 12492, 3)
    assert old.templates.detect_prefix == (198, 198, 47504, 25)
    assert preset("moondream2-2025-04-14").tokens.size_scale == "log"


def test_invalid_configs_are_refused() -> None:
    with pytest.raises(ValueError):
        TextConfig(dim=100, n_heads=3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dataclasses.replace(
            preset("tiny"),
            text=dataclasses.replace(
                preset("tiny").text,
                vocab_size=1000,
            ),
            tokenizer_vocab_size=1000,
            tokens=preset("moondream2-2025-01-09").tokens,
        )
