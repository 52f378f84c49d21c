"""``--weights fp8`` and ``auto`` on a GPU with FP8 units: Moondream 3's experts quantized to
FP8 at load from 16-bit weights, the model answering; ``auto`` resolved at start on the
device's own memory."""

from __future__ import annotations

import pytest
import torch

from image_pipeline import prepare_image, sample_image_bytes
from vlm_server.chip_features import fp8_supported
from vlm_server.engine.config import EngineConfig
from vlm_server.models.registry import preset, random_model, write_checkpoint
from vlm_server.reference import ReferenceGenerator
from vlm_server.server.weights_start import start_weights

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 units")
    return torch.device("cuda")


def test_fp8_experts_from_16_bit_weights(cuda: torch.device) -> None:
    config = preset("moondream3-tiny")
    fp8 = random_model(config, device=cuda, progress=False, weights="fp8")
    plain = random_model(config, device=cuda, progress=False)
    dtypes = {p.dtype for p in fp8.model.state_dict().values()}
    assert torch.float8_e4m3fn in dtypes
    image = prepare_image(sample_image_bytes())
    ids = plain.tokenizer.encode("What is in this picture?").ids
    a, b = (
        ReferenceGenerator(m.model, m.tokenizer).next_logits(image, ids).float()[0]
        for m in (plain, fp8)
    )
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.95


def test_auto_on_the_device(cuda: torch.device, tmp_path) -> None:
    folder = write_checkpoint(preset("moondream3-tiny"), tmp_path / "md3", progress=False)
    assert start_weights(str(folder), None, "auto", EngineConfig(), cuda) == "bf16"
    with pytest.raises(ValueError, match="no format holds the model"):
        start_weights(str(folder), None, "auto", EngineConfig(gpu_memory_bytes=1 << 20), cuda)
