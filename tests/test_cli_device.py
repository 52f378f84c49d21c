"""``vlm run --device`` with a device this machine or torch build lacks: one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlm_server.cli import main as cli_main
from vlm_server.devices import resolve_device


@pytest.mark.parametrize(
    ("device", "words"),
    [
        ("bogus", "unknown device 'bogus'"),
        ("cuda:x", "unknown device"),
        ("meta", "unsupported device"),
        pytest.param(
            "cuda",
            "CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
)
def test_vlm_run_refuses_a_device_it_cannot_use_in_one_line(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], device: str, words: str
) -> None:
    args = ["run", "caption", "sample", "--model", str(tiny_dir), "--device", device]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vlm: error:") and words in err[0]


def test_resolve_device_defaults_to_what_is_present() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected
    assert resolve_device("cpu") == torch.device("cpu")
