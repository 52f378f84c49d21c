"""The device layer reads a step as values built at launch (core/step_inputs.py), never a
`Sequence`: neither it nor anything it imports at run time imports core/sequence.py, so no
device work can see a sequence move on under it."""

from __future__ import annotations

import ast
from importlib.util import resolve_name
from pathlib import Path

import pytest

from tests.test_layout import ROOT, _imports, _modules

SEQUENCE = "vlm_server.engine.core.sequence"
DEVICE = "vlm_server.engine.device"
PROTOCOL = "vlm_server.engine.core.runtime_protocol"


def _named(source: str, package: str) -> set[str]:
    """Every module an import of ``source`` names (and ``module.name`` of each name taken from
    one), anywhere in it: TYPE_CHECKING blocks and function bodies too. ``package``: where
    relative imports start."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_name("." * node.level + (node.module or ""), package)
            out |= {base, *(f"{base}.{a.name}" for a in node.names)}
    return out


def _names_sequence(named: set[str]) -> bool:
    return any(name == SEQUENCE or name.startswith(SEQUENCE + ".") for name in named)


def _device_layer() -> dict[str, Path]:
    """Every module of the device layer, and the protocol the scheduler drives it through."""
    layer = {
        name: path
        for name, path in _modules().items()
        if name in (DEVICE, PROTOCOL) or name.startswith(DEVICE + ".")
    }
    assert PROTOCOL in layer and f"{DEVICE}.forwards" in layer  # the walk found them
    return layer


def test_the_device_layer_names_nothing_of_the_sequences() -> None:
    """Not even for type hints: what the device reads of a step comes as values."""
    offenders = []
    for name, path in sorted(_device_layer().items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        if _names_sequence(_named(path.read_text(), package)):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], f"these import {SEQUENCE}: {offenders}"


def test_nothing_the_device_layer_imports_at_run_time_imports_the_sequences() -> None:
    """The closure of the device layer's run-time imports, packages' __init__ included."""
    modules = _modules()
    known = set(modules)
    by: dict[str, str] = {}  # each module reached, and a module that imports it
    todo = [(name, "") for name in _device_layer()]
    while todo:
        name, importer = todo.pop()
        if name in by:
            continue
        by[name] = importer
        parts = name.split(".")
        todo += [
            (".".join(parts[:i]), name)
            for i in range(2, len(parts))
            if ".".join(parts[:i]) in known
        ]
        todo += [(dep, name) for dep in _imports(name, modules[name], known)]
    assert "vlm_server.engine.core.step_plan" in by  # the walk follows the imports
    chain = [SEQUENCE]
    while by.get(chain[-1]):
        chain.append(by[chain[-1]])
    assert SEQUENCE not in by, " <- ".join(chain)


@pytest.mark.parametrize(
    "source",
    [
        "from vlm_server.engine.core.sequence import Sequence",
        "import vlm_server.engine.core.sequence",
        "from vlm_server.engine.core import sequence",
        "from ..core.sequence import Sequence",
        "from ..core import sequence",
        "if TYPE_CHECKING:\n    from ..core.sequence import Sequence",
        "def f():\n    from vlm_server.engine.core.sequence import Sequence",
    ],
)
def test_the_check_sees_every_way_to_import_the_module(source: str) -> None:
    assert _names_sequence(_named(source, DEVICE))
    assert not _names_sequence(_named("from ..core import pages", DEVICE))
