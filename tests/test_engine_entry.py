"""The engine has one entry (`BatchedEngine.admit`, engine/intake.py), and no event loop:
asyncio lives at the edge that serves it in the server's process (server/in_process.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOOP_FREE = ["engine/engine.py", "engine/intake.py", "engine/process/worker.py"]


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", LOOP_FREE)
def test_the_engine_and_its_process_run_no_event_loop(module: str) -> None:
    assert "asyncio" not in _imported(ROOT / "vlm_server" / module)


def test_the_engine_process_routes_nothing_itself() -> None:
    """Its host hands each submission to the engine's entry: it runs no thread pool of its
    own and builds, decodes or queues nothing."""
    source = (ROOT / "vlm_server/engine/process/worker.py").read_text()
    assert "concurrent.futures" not in _imported(ROOT / "vlm_server/engine/process/worker.py")
    for call in (".build(", ".decode_image(", ".queue("):
        assert call not in source, call
    assert source.count(".admit(") == 1
