"""API keys: who may call, and who a caller is. Both doors check keys with `ApiKeys`; the
identity of a key names its holder (per-client quotas, the owner of batch jobs) without
revealing it.

Keys are kept as SHA-256 digests and compared in constant time, so neither the check's timing
nor a memory dump of the set hands out a key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

# The one owner of everything when the server takes no API keys.
ANONYMOUS = "anonymous"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys_file(path: str | Path) -> tuple[str, ...]:
    """Keys from a file, one a line; blank lines and ``#`` comments skipped."""
    lines = Path(path).read_text().splitlines()
    return tuple(k for k in (line.split("#", 1)[0].strip() for line in lines) if k)


class ApiKeys:
    """A set of accepted API keys; ``keys(token)`` is True for an accepted one."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple({_digest(k) for k in keys if k})
        if not self._digests:
            raise ValueError("no API keys given")

    def __len__(self) -> int:
        return len(self._digests)

    def __call__(self, key: str | None) -> bool:
        if not key:
            return False
        candidate = _digest(key)
        # Every stored digest is compared: the time taken does not depend on which matched.
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(candidate, digest)
        return found

    check = __call__

    @staticmethod
    def identity(key: str) -> str:
        """A stable name for the holder of ``key`` that does not reveal it."""
        return "key:" + _digest(key).hex()[:16]
