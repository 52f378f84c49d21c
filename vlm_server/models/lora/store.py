"""Where adapter files come from: the adapter folder, else a download from the configured
endpoint (the reference's URL and header), saved where the reference caches it.

`AdapterStore.path` blocks (file system, network): callers run it on a thread of their own,
never on an event loop or the engine's scheduler thread. A download is bounded in bytes and
in time, written to a temporary file and renamed into place only once complete.
"""

from __future__ import annotations

import os
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vlm_server.models.lora import files
from vlm_server.models.lora.files import AdapterError

API_KEY_ENV = "MOONDREAM_API_KEY"  # the reference reads the key from here too
CHUNK = 1 << 20


@dataclass
class AdapterStore:
    folder: Path | None  # local adapters (and downloads); None: downloads go to a temp dir
    endpoint: str | None = None  # e.g. https://api.moondream.ai; None: no downloads
    api_key: str | None = None
    max_bytes: int = 1 << 30
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        self._downloads = Path(self.folder) if self.folder else None

    @property
    def enabled(self) -> bool:
        return self.folder is not None or self.endpoint is not None

    def path(self, name: str) -> Path:
        """The file of adapter ``name``: found in the folder, or downloaded."""
        files.check_id(name)
        for folder in (self.folder, self._downloads):
            if folder is not None and (found := files.find(Path(folder), name)) is not None:
                return found
        if self.endpoint is None:
            raise AdapterError(f"adapter {name!r} is not in the adapter folder")
        return self.download(name)

    def download(self, name: str) -> Path:
        """``<endpoint>/v1/variants/<name>/download`` (header ``X-Moondream-Auth``) into
        ``<folder>/<name>/final.pt``."""
        if self._downloads is None:
            self._downloads = Path(tempfile.mkdtemp(prefix="adapters-"))
        dest = self._downloads / name / "final.pt"
        dest.parent.mkdir(parents=True, exist_ok=True)
        url = f"{str(self.endpoint).rstrip('/')}/v1/variants/{name}/download"
        headers = {"User-Agent": "vlm-server"}
        if self.api_key:
            headers["X-Moondream-Auth"] = self.api_key
        deadline = time.monotonic() + self.timeout_s
        fd, tmp = tempfile.mkstemp(dir=dest.parent, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                request = urllib.request.Request(url, headers=headers)
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    size = 0
                    while chunk := response.read(CHUNK):
                        size += len(chunk)
                        if size > self.max_bytes:
                            raise AdapterError(
                                f"adapter {name!r}: the download exceeds {self.max_bytes} bytes"
                            )
                        if time.monotonic() > deadline:
                            raise AdapterError(
                                f"adapter {name!r}: the download took over {self.timeout_s:g} s",
                                retryable=True,
                            )
                        out.write(chunk)
            os.replace(tmp, dest)
        except AdapterError:
            raise
        except urllib.error.HTTPError as err:
            raise AdapterError(
                f"adapter {name!r}: the download failed: HTTP {err.code} {err.reason}",
                retryable=err.code >= 500,
            ) from None
        except (OSError, ValueError) as err:  # refused, timed out, reset, bad URL
            raise AdapterError(f"adapter {name!r}: the download failed: {err}", True) from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return dest
