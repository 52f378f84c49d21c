"""Ray Serve's proxy checks, loosened for two busy cores: a proxy actor that takes more than
5 s to import and report ready is killed as unhealthy (and ``serve.start`` fails with it),
which a CI machine running another job beside the tests reaches. The tests give it minutes;
a proxy that never starts still fails them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


@contextmanager
def patient_proxies() -> Iterator[None]:
    """`ENV` in this process's environment (Ray's processes started meanwhile inherit it)."""
    saved = {name: os.environ.get(name) for name in ENV}
    os.environ.update(ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
