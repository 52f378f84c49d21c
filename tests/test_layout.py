"""The package layout keeps its promises: a torch-free engine core, no import cycles between
packages, dependencies pointing down, and test doubles never shipped in the package."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vlm_server.models.families import FAMILIES as FAMILY_TABLE

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["vlm_server", "decoding", "image_pipeline"]
# Each family's package: the one its table line names the module of.
FAMILIES = tuple(module.rpartition(".")[0] for module in FAMILY_TABLE.values())

# Higher layers may import lower ones, never the reverse (docs/architecture.md, Layout).
LAYERS = {
    "image_pipeline": 0,
    "decoding": 0,
    "vlm_server.devices": 0,  # which torch devices this machine has
    "vlm_server.chips": 0,  # what each GPU can do: the chip table and its limits (no torch)
    "vlm_server.chip_features": 0,  # what the GPU can do, checked at start
    "vlm_server.gc_pauses": 0,  # this process's garbage-collection pauses
    "vlm_server.api": 0,  # generated gRPC code
    "vlm_server.client": 1,  # talks to a server through vlm_server.api only
    # The seam (protocols, capabilities, tokenizer contract, prompts, KV contract, checkpoint
    # reading) and the blocks families share (models/common); then the families, each a line
    # of models/families.py; then the registry that knows them all.
    "vlm_server.models": 1,
    **dict.fromkeys(FAMILIES, 2),
    "vlm_server.models.registry": 3,
    "vlm_server.models.quantized": 3,  # quantized checkpoints of any family, via the registry
    "vlm_server.default_model": 3,
    "vlm_server.engine": 3,  # the package itself (its __init__ is empty)
    "vlm_server.engine.core": 3,
    "vlm_server.engine.requests": 3,
    "vlm_server.engine.api": 3,
    "vlm_server.engine.config": 3,
    "vlm_server.engine.device": 4,
    "vlm_server.plan_view": 4,  # the memory plan of a model on a card, as text
    "vlm_server.engine.engine": 5,
    "vlm_server.engine.adapters": 5,  # adapter files, downloads and slots, around the runtime
    "vlm_server.engine.process": 5,  # the engine in its own process, around engine.engine
    "vlm_server.reference": 5,
    "vlm_server.options": 6,  # the option table: flags, environment, ServerConfig
    "vlm_server.frontend": 7,  # the request path both doors share: calls, checks, images
    "vlm_server.rpc": 8,  # the gRPC door
    "vlm_server.http": 8,  # the HTTP door (neither door imports the other)
    "vlm_server.bulk": 9,  # requests read from files (vlm batch, the Batch API), via the routes
    "vlm_server.server": 10,  # the process: both doors, health, metrics, memory, drain
    "vlm_server.cluster": 11,  # replicas of the server on Ray Serve, and their router
    "vlm_server.cli": 11,
    "vlm_server.plan_command": 11,  # vlm plan
    "vlm_server.quantize_command": 11,  # vlm quantize
    "vlm_server.batch_command": 11,  # vlm batch: the server's engine and core, no doors
    "vlm_server.compare_scores": 0,  # how alike two models' answers are (pure functions)
    "vlm_server.compare_command": 11,  # vlm compare: two models through vlm batch's runs
}


def test_the_engine_core_imports_no_torch() -> None:
    """Import every core module (and what they import) where importing torch raises."""
    modules = sorted(
        f"vlm_server.engine.core.{p.stem}"
        for p in (ROOT / "vlm_server/engine/core").glob("*.py")
        if p.stem != "__init__"
    )
    code = textwrap.dedent(
        f"""
        import importlib, importlib.abc, sys

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch.") or name == "triton":
                    raise ImportError("the engine core must not import " + name)
                return None

        sys.meta_path.insert(0, NoTorch())
        for name in {modules!r}:
            importlib.import_module(name)
        importlib.import_module("vlm_server.engine.requests.tasks")
        assert "torch" not in sys.modules
        print("ok", len({modules!r}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")


def _modules() -> dict[str, Path]:
    found = {}
    for top in SHIPPED:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if len(parts) > 1:  # the top-level packages' own __init__ files are empty
                found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``name`` imports at run time (TYPE_CHECKING blocks skipped)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
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
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(tree.body)
    return {m for m in out if m in known and m != name}


def _layer(module: str) -> tuple[str, int] | None:
    best = None
    for prefix, level in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, level)
    return best


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_dependencies_point_down(graph: dict[str, set[str]]) -> None:
    upward = []
    for name, deps in graph.items():
        mine = _layer(name)
        for dep in deps:
            theirs = _layer(dep)
            if mine and theirs and theirs[1] > mine[1]:
                upward.append(f"{name} -> {dep}")
    unlayered = sorted(name for name in graph if _layer(name) is None)
    assert not unlayered, f"modules with no layer in LAYERS: {unlayered}"
    assert not upward, "imports that climb the layers:\n" + "\n".join(sorted(upward))


# Imports between packages of the same layer are allowed only here, each for a reason the
# architecture's layout table gives; any other (one door importing the other, one family
# importing another) fails.
SAME_LAYER_IMPORTS = {
    ("vlm_server.chip_features", "vlm_server.chips"),  # the device's report, the table's rest
    ("vlm_server.cli", "vlm_server.cluster"),  # `vlm cluster` and `vlm gateway`
    ("vlm_server.cli", "vlm_server.batch_command"),  # `vlm batch`
    ("vlm_server.cli", "vlm_server.plan_command"),  # `vlm plan`
    ("vlm_server.cli", "vlm_server.quantize_command"),  # `vlm quantize`
    ("vlm_server.cli", "vlm_server.compare_command"),  # `vlm compare`
    ("vlm_server.compare_command", "vlm_server.batch_command"),  # its runs are vlm batch's
    ("vlm_server.models.quantized", "vlm_server.models.registry"),  # any family's files
    ("vlm_server.default_model", "vlm_server.models.registry"),  # the built-in model's family
    ("vlm_server.engine", "vlm_server.engine.api"),  # refinements and the step trace: events
    ("vlm_server.engine", "vlm_server.engine.core"),  # ... over the core's outputs and observer
    ("vlm_server.engine.core", "vlm_server.engine.api"),  # the request and event types
    ("vlm_server.engine.core", "vlm_server.engine.config"),  # the scheduler's configuration
    ("vlm_server.engine.requests", "vlm_server.engine.api"),  # requests -> prompts, grammars
    ("vlm_server.engine.engine", "vlm_server.engine.adapters"),  # adapter slots of a request
    ("vlm_server.engine.process", "vlm_server.engine.engine"),  # a pipe around the engine
}


def test_no_imports_within_a_layer_but_the_declared_ones(graph: dict[str, set[str]]) -> None:
    """Packages of one layer are siblings: neither door imports the other, no family imports
    another; the few same-layer imports the layout needs are declared above."""
    found: dict[tuple[str, str], list[str]] = {}
    for name, deps in graph.items():
        mine = _layer(name)
        for dep in deps:
            theirs = _layer(dep)
            if mine and theirs and mine[1] == theirs[1] and mine[0] != theirs[0]:
                found.setdefault((mine[0], theirs[0]), []).append(f"{name} -> {dep}")
    undeclared = sorted(
        line for pair, lines in found.items() if pair not in SAME_LAYER_IMPORTS for line in lines
    )
    assert not undeclared, "imports within a layer:\n" + "\n".join(undeclared)
    stale = sorted(f"{a} -> {b}" for a, b in SAME_LAYER_IMPORTS - found.keys())
    assert not stale, "declared same-layer imports that no longer exist: " + ", ".join(stale)


def test_no_import_cycles_between_packages(graph: dict[str, set[str]]) -> None:
    def package(mod: str) -> str:
        hit = _layer(mod)
        return hit[0] if hit else mod.rpartition(".")[0] or mod

    edges: dict[str, set[str]] = {}
    for name, deps in graph.items():
        for dep in deps:
            a, b = package(name), package(dep)
            if a != b:
                edges.setdefault(a, set()).add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("package import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            dfs(node)


def test_only_the_registry_imports_a_model_family(graph: dict[str, set[str]]) -> None:
    """The engine, the reference and the doors are typed against models/interface.py: a new
    family plugs in through the registry without touching them."""
    leaks = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        for dep in deps
        if dep.startswith(FAMILIES)
        and not name.startswith(FAMILIES)
        and name != "vlm_server.models.registry"
    )
    assert not leaks, "modules that import a family directly:\n" + "\n".join(leaks)


def test_no_family_imports_another(graph: dict[str, set[str]]) -> None:
    """What families share lives in models/common, not in one of them."""
    crossing = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        for dep in deps
        for mine in FAMILIES
        if name.startswith(mine + ".") and dep.startswith(FAMILIES) and not dep.startswith(mine)
    )
    assert not crossing, "families importing each other:\n" + "\n".join(crossing)


def test_test_doubles_are_not_shipped() -> None:
    shipped = [p for top in SHIPPED for p in (ROOT / top).rglob("*.py")]
    names = {p.stem for p in shipped}
    assert not names & {"fake_runtime", "fake_device", "testing", "toy_tokenizers"}
