"""The device layer reads a step as values built at launch (core/step_inputs.py), never a
`Sequence`: neither it nor anything it imports at run time imports core/sequence.py, so no
device work can see a sequence move on under it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEQUENCE = "vlm_server.engine.core.sequence"
PROJECT = ("vlm_server", "decoding", "image_pipeline")


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _path_of(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _imports(path: Path, type_checking: bool) -> set[str]:
    """What the module at ``path`` imports (see `_imports_in`)."""
    return _imports_in(
        path.read_text(), _module_of(path), path.name == "__init__.py", type_checking
    )


def _imports_in(source: str, module: str, is_package: bool, type_checking: bool) -> set[str]:
    """What ``source`` of ``module`` imports: modules, and ``module.name`` of each name taken
    from one (relative imports resolved); ``type_checking``: TYPE_CHECKING blocks too. Imports
    inside functions count: they run too."""
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body if type_checking else []:
                visit(child)
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return out


def _device_layer() -> list[Path]:
    """Every module of the device layer, and the protocol the scheduler drives it through."""
    return [
        *sorted((ROOT / "vlm_server/engine/device").rglob("*.py")),
        ROOT / "vlm_server/engine/core/runtime_protocol.py",
    ]


def _names_sequence(imported: set[str]) -> bool:
    return any(name == SEQUENCE or name.startswith(SEQUENCE + ".") for name in imported)


def test_the_device_layer_imports_nothing_of_the_sequences() -> None:
    """Not even for type hints: what the device reads of a step comes as values."""
    modules = _device_layer()
    assert len(modules) > 10  # the glob found the package
    offenders = [
        str(path.relative_to(ROOT))
        for path in modules
        if _names_sequence(_imports(path, type_checking=True))
    ]
    assert offenders == [], f"these import {SEQUENCE}: {offenders}"


def test_nothing_the_device_layer_imports_at_run_time_imports_the_sequences() -> None:
    """The closure of the device layer's run-time imports (packages' __init__ included)."""
    by: dict[str, str] = {}  # each module reached, and a module that imports it
    todo = [(_module_of(p), "") for p in _device_layer()]
    while todo:
        module, importer = todo.pop()
        if module in by:
            continue
        by[module] = importer
        path = _path_of(module)
        if path is None:
            continue  # a name taken from a module, not a module
        parts = module.split(".")
        todo += [(".".join(parts[:i]), module) for i in range(1, len(parts))]
        imported = _imports(path, type_checking=False)
        todo += [(m, module) for m in imported if m.startswith(PROJECT)]
    assert "vlm_server.engine.core.step_plan" in by  # the walk follows the imports
    chain = [SEQUENCE]
    while chain[-1] in by and by[chain[-1]]:
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
def test_the_import_check_sees_every_way_to_name_the_module(source: str) -> None:
    module = "vlm_server.engine.device.forwards"
    assert _names_sequence(_imports_in(source, module, False, type_checking=True))
    assert not _names_sequence(_imports_in("from ..core import pages", module, False, True))
