"""Generate the Python gRPC code in ``vlm_server/api`` from ``protos/``.

Run ``python -m vlm_server.service.codegen`` after editing a .proto file and commit the
result; a test fails when the checked-in code is stale. The generator is pinned: the code it
writes demands ``grpcio >= GRPCIO_TOOLS_VERSION`` at import time, so a newer generator would
silently raise the runtime requirement of every deployment.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import shutil
import sys
import tempfile
from pathlib import Path

GRPCIO_TOOLS_VERSION = "1.84.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
API_DIR = REPO_ROOT / "vlm_server" / "api"
PROTO_FILES = ("vlm/v1/vision_language.proto",)

_INIT_TEXT = {
    "__init__.py": '"""Generated gRPC code (python -m vlm_server.service.codegen). Do not edit."""\n',
    "v1/__init__.py": '"""Generated from protos/vlm/v1 (python -m vlm_server.service.codegen)."""\n',
}


class CodegenError(RuntimeError):
    """The generator is missing, has the wrong version, or protoc failed."""


def _check_generator() -> None:
    try:
        version = importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        raise CodegenError(
            f"grpcio-tools is not installed (pip install grpcio-tools=={GRPCIO_TOOLS_VERSION})"
        ) from None
    if version != GRPCIO_TOOLS_VERSION:
        raise CodegenError(
            f"grpcio-tools {version} is installed; the checked-in code is generated with "
            f"{GRPCIO_TOOLS_VERSION} (pip install grpcio-tools=={GRPCIO_TOOLS_VERSION})"
        )


def _make_relative(path: Path) -> None:
    # protoc writes absolute imports named after the proto path (``from vlm.v1 import``);
    # the generated modules live inside this package, so import their siblings relatively.
    text = path.read_text()
    path.write_text(text.replace("from vlm.v1 import ", "from . import "))


def generate(out_dir: Path) -> list[Path]:
    """Write the generated package (what belongs in ``vlm_server/api``) into ``out_dir``."""
    _check_generator()
    from grpc_tools import protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *(str(PROTO_ROOT / name) for name in PROTO_FILES),
        ]
        if protoc.main(args) != 0:
            raise CodegenError(f"protoc failed on {', '.join(PROTO_FILES)}")
        written = []
        for name in PROTO_FILES:
            stem = Path(name).with_suffix("")
            version_dir = stem.parent.name  # "v1"
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                src = Path(raw) / f"{stem}{suffix}"
                dst = out_dir / version_dir / src.name
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
                _make_relative(dst)
                written.append(dst)
    for rel, text in _INIT_TEXT.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return sorted(written)


def generated_files(directory: Path) -> dict[str, bytes]:
    """Relative path -> content of every generated file under ``directory``."""
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def main(argv: list[str] | None = None) -> int:
    """Regenerate ``vlm_server/api`` (or check it with ``--check``)."""
    parser = argparse.ArgumentParser(prog="python -m vlm_server.service.codegen",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the checked-in code differs from a fresh generation")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            fresh = generated_files(Path(tmp))
            if args.check:
                if fresh != generated_files(API_DIR):
                    print("vlm_server/api is stale: run python -m vlm_server.service.codegen",
                          file=sys.stderr)
                    return 1
                return 0
            if API_DIR.exists():
                shutil.rmtree(API_DIR)
            shutil.copytree(tmp, API_DIR)
    except CodegenError as err:
        print(f"codegen: {err}", file=sys.stderr)
        return 1
    print(f"wrote {len(fresh)} files to {API_DIR.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
