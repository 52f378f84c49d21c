"""Adapter files read in child processes (engine/adapter_reader.py): the same packed slot as in
process, the same refusals, reads beyond the bound waiting their turn, a dead or overdue
child replaced, and the engine process itself parsing no adapter file."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from image_pipeline import PreparedImage
from vlm_server.engine.adapter_reader import AdapterReader, read_into
from vlm_server.engine.api import Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.models.lora import files
from vlm_server.models.lora.files import AdapterError
from vlm_server.models.lora.layout import SlotLayout
from vlm_server.models.lora.spec import LoraTargets
from vlm_server.models.lora.writer import random_state, write_random
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.server.in_process import InProcessEngine

TARGETS = LoraTargets(
    2,
    {"qkv": (16, 48), "proj": (16, 16), "fc1": (16, 64), "fc2": (64, 16)},
    shared=(("qkv", "proj", "fc1"),),
)
LAYOUT = SlotLayout(TARGETS, 4)
DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def reader() -> Iterator[AdapterReader]:
    r = AdapterReader(children=1)
    yield r
    r.close()


def _in_process(path: Path, name: str) -> tuple[int, torch.Tensor]:
    flat = torch.empty(LAYOUT.numel, dtype=DTYPE)
    return read_into(path, name, LAYOUT, flat), flat


def test_a_child_packs_what_the_process_packs(reader: AdapterReader, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    pt = write_random(tmp_path, "a", TARGETS, 3, seed=1)
    st = tmp_path / "b.safetensors"
    save_file(random_state(TARGETS, 4, seed=2, dtype=torch.bfloat16), str(st))
    for path, name, rank in ((pt, "a", 3), (st, "b", 4)):
        want_rank, want = _in_process(path, name)
        got = reader.read(path, name, LAYOUT, DTYPE)
        try:
            assert got.rank == want_rank == rank
            assert torch.equal(got.packed, want)
        finally:
            got.release()
    # The packed slot is the file's adapter in the bank's layout (padded, converted).
    weights = files.load(pt, TARGETS, 4, "a")
    groups, b = LAYOUT.views(_in_process(pt, "a")[1])
    a = LAYOUT.target_a(groups)
    wa, wb = weights.pairs[1]["proj"]
    assert torch.equal(a["proj"][1, :3], wa.to(DTYPE)) and not a["proj"][1, 3:].any()
    assert torch.equal(b["proj"][1, :, :3], wb.to(DTYPE)) and not b["proj"][1, :, 3:].any()


def _bad_files(folder: Path) -> dict[str, Path]:
    (folder / "broken.pt").write_bytes(b"not a checkpoint")
    out = {"broken": folder / "broken.pt", "wide": write_random(folder, "wide", TARGETS, 5)}
    for name in ("missing", "shapes"):
        path = write_random(folder, name, TARGETS, 2)
        state = torch.load(path, weights_only=True)
        key = "text_model.transformer.h.1.mlp.fc2.parametrizations.weight.0.A"
        if name == "missing":
            del state[key]
        else:
            state[key] = state[key][:, :-1]
        torch.save(state, path)
        out[name] = path
    return out


def test_a_child_refuses_what_the_process_refuses(reader: AdapterReader, tmp_path: Path) -> None:
    for name, path in _bad_files(tmp_path).items():
        with pytest.raises(AdapterError) as here:
            files.load(path, TARGETS, 4, name)
        with pytest.raises(AdapterError) as there:
            reader.read(path, name, LAYOUT, DTYPE)
        assert str(there.value) == str(here.value) and f"adapter {name!r}" in str(there.value)
        assert not there.value.retryable
    started = reader.started
    good = reader.read(write_random(tmp_path, "good", TARGETS, 2), "good", LAYOUT, DTYPE)
    good.release()
    assert good.rank == 2 and reader.started == started  # the same child served on


def test_reads_beyond_the_bound_wait_their_turn(reader: AdapterReader, tmp_path: Path) -> None:
    paths = [write_random(tmp_path, f"w{i}", TARGETS, 2, seed=i) for i in range(2)]
    first = reader.read(paths[0], "w0", LAYOUT, DTYPE)  # holds the one child
    done = threading.Event()
    second: list = []

    def other() -> None:
        second.append(reader.read(paths[1], "w1", LAYOUT, DTYPE))
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    assert not done.wait(0.5)  # it cannot have a child while the first read holds it
    want = first.packed.clone()
    first.release()
    thread.join()
    assert done.is_set()
    second[0].release()
    assert not torch.equal(second[0].packed, want)  # the buffer now holds the second read
    assert reader.children == 1


def test_a_dead_or_overdue_child_is_replaced(reader: AdapterReader, tmp_path: Path) -> None:
    path = write_random(tmp_path, "x", TARGETS, 2)
    reader.read(path, "x", LAYOUT, DTYPE).release()
    (pid,) = reader.pids
    os.kill(pid, signal.SIGKILL)
    started = reader.started
    reader.read(path, "x", LAYOUT, DTYPE).release()  # a new child reads it
    assert reader.started == started + 1 and reader.pids != [pid]
    with pytest.raises(TimeoutError):  # the request's deadline passed: the child is stopped
        reader.read(path, "x", LAYOUT, DTYPE, until=time.monotonic() - 1)
    assert reader.pids == []
    reader.read(path, "x", LAYOUT, DTYPE).release()
    assert reader.started == started + 2


def test_the_engine_process_parses_no_adapter_file(
    tiny: LoadedModel,
    sample_image: PreparedImage,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading, renaming and checking a file fail in this process: the engine still loads
    the adapter (a child read it) and answers as the reference does with it."""
    targets = tiny.model.text.lora_targets
    write_random(tmp_path, "alpha", targets, rank=4, seed=3, scale=0.3)
    weights = files.load(files.find(tmp_path, "alpha"), targets, 4, "alpha")  # type: ignore[arg-type]
    req = GenerationRequest(
        Task.CAPTION, sample_image, temperature=0, max_tokens=8, adapter="alpha"
    )
    ref = ReferenceGenerator(tiny.model, tiny.tokenizer, weights)
    want = ref.caption(sample_image, "normal", SamplingSettings(temperature=0, max_tokens=8))

    def parse_here(*args: object, **kw: object) -> None:
        raise AssertionError("the engine process parsed an adapter file")

    for name in ("read_tensors", "validate", "load"):
        monkeypatch.setattr(files, name, parse_here)
    monkeypatch.setattr(torch, "load", parse_here)
    cfg = EngineConfig(
        max_batch_size=2, kv_budget_bytes=16 << 20, adapters_dir=str(tmp_path), max_adapter_rank=4
    )

    async def run() -> str:
        engine = InProcessEngine(BatchedEngine(tiny, cfg))
        await engine.start()
        try:
            async for event in await engine.submit(req):
                if isinstance(event, Finished):
                    return event.text
            raise AssertionError("no result")
        finally:
            await engine.close()

    assert asyncio.run(run()) == want.text
