"""The README's promises: its Python example runs and prints the caption once; it answers
a new user's first questions; pyproject names only package data that exists."""

from __future__ import annotations

import contextlib
import io
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from image_pipeline import sample_image_bytes
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.client import VisionLanguageClient
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _python_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
    grpc_examples = [b for b in blocks if "caption_stream(" in b]
    assert len(grpc_examples) == 1
    return grpc_examples[0]


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    with ServerThread(
        local_config(),
        in_process(
            lambda: BatchedEngine(tiny, EngineConfig(max_batch_size=1, kv_budget_bytes=16 << 20))
        ),
    ) as running:
        yield running


def test_the_python_example_prints_the_caption_once(server: ServerThread, tmp_path: Path) -> None:
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(sample_image_bytes())
    code = _python_example().replace("localhost:50051", server.target)
    code = code.replace('"photo.jpg"', repr(str(photo)))
    code = code.replace(
        "client.caption_stream(image)", "client.caption_stream(image, max_tokens=12)"
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue()
    with VisionLanguageClient(server.target, timeout=60) as client:
        caption = client.caption(sample_image_bytes(), max_tokens=12).text
    assert caption and printed.count(caption) == 1, printed


@pytest.mark.parametrize(
    "needle",
    [
        "(seed 0)",  # the built-in model's seed
        "moondream-serve/models/tiny-seed0",  # where it is cached
        "download.pytorch.org/whl/cu",  # the GPU torch install
        "download vikhyatk/moondream2",  # real weights
        "download moondream/starmie-v1 tokenizer.json",  # the 2025-06 tokenizer
        "vlm-client caption sample",  # vlm-client takes `sample` too
        "--api-keys-file",
        "--tls-cert",
        "--metrics-host",
    ],
)
def test_the_readme_answers_a_new_users_questions(needle: str) -> None:
    assert needle in README


def test_package_data_globs_match_files() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = config["tool"]["setuptools"].get("package-data", {})
    for package, globs in package_data.items():
        for pattern in globs:
            assert list((ROOT / package).glob(pattern)), f"{package}/{pattern} matches nothing"
