"""Resolve a model source: a local path, or a Hugging Face repo id through huggingface_hub."""

from __future__ import annotations

import re
from pathlib import Path

from vlm_server.models.checkpoint_io import CheckpointError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_PATTERNS = ["*.safetensors", "*.json"]


def looks_like_repo_id(source: str) -> bool:
    return bool(_REPO_ID.match(source))


def resolve_source(source: str | Path, patterns: list[str] | None = None) -> Path:
    """A local file or directory as is; ``owner/name[@revision]`` via the Hub's local cache or
    a download of the files matching ``patterns`` (default: weights and configs). Fails with
    a `CheckpointError` that says what to do when offline."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    text = str(source)
    if not looks_like_repo_id(text):
        raise CheckpointError(
            f"model source {text!r} is neither an existing path nor a "
            "Hugging Face repo id (owner/name[@revision])"
        )
    repo_id, _, revision = text.partition("@")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(
            f"{text!r} looks like a Hugging Face repo id, but huggingface_hub is not installed; "
            "install it (pip install 'moondream-serve[hub]') or pass a local directory"
        ) from None
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision or None, allow_patterns=patterns or _PATTERNS
            )
        )
    except Exception as err:  # the hub raises many types: offline, 404, auth, disk
        raise CheckpointError(
            f"could not fetch {text!r} from the Hugging Face Hub and no complete local copy is "
            f"cached ({type(err).__name__}: {err}). When offline, download the snapshot "
            "elsewhere and pass its directory, or set HF_HUB_CACHE to a cache that holds it"
        ) from err


def resolve_file(source: str | Path, filename: str) -> Path:
    """One file: ``source`` itself, ``filename`` in the directory ``source``, or ``filename``
    of the Hub repo ``source`` (`resolve_source`'s rules and errors)."""
    path = resolve_source(source, [filename])
    if path.is_dir():
        path = path / filename
    if not path.is_file():
        raise CheckpointError(f"{source!r} holds no {filename}")
    return path
