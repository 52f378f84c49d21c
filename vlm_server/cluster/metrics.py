"""Every replica's Prometheus metrics in one place: each sample labelled with its replica,
plus the sum over replicas (``replica="all"``) of every counter and gauge.

``vlm cluster`` serves this on ``--metrics-host``/``--metrics-port`` (each replica keeps its own
endpoint on an ephemeral port, listed in the replica directory); the tests and the benchmark
read the per-replica values through `scrape_all`.
"""

from __future__ import annotations

import http.server
import threading
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted labels)
_SUMMED = {"counter", "gauge"}


def scrape(endpoint: str, timeout: float = 5.0) -> str:
    """The metrics text of one ``host:port``."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout) as response:
        return response.read().decode()


def scrape_all(endpoints: dict[str, str], timeout: float = 5.0) -> dict[str, str]:
    """Replica -> metrics text, for the replicas that answer (a dead one's entry lingers)."""
    out = {}
    for name, endpoint in endpoints.items():
        try:
            out[name] = scrape(endpoint, timeout)
        except OSError:
            continue
    return out


def samples(text: str) -> dict[Sample, float]:
    out: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(text).items() if n == name and want <= set(ls))


def _line(name: str, labels: tuple[tuple[str, str], ...], v: float) -> str:
    inner = ",".join(f'{k}="{val}"' for k, val in labels)
    return f"{name}{{{inner}}} {v}\n"


def aggregate(texts: dict[str, str]) -> str:
    """One exposition: every sample with a ``replica`` label, and the sums (``all``)."""
    lines: list[str] = []
    sums: dict[Sample, float] = defaultdict(float)
    kinds: dict[str, str] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted({**s.labels, "replica": replica}.items()))
                lines.append(_line(s.name, labels, s.value))
                if family.type in _SUMMED:
                    kinds[s.name] = family.type
                    sums[(s.name, tuple(sorted(s.labels.items())))] += s.value
    for (name, labels), total in sorted(sums.items()):
        lines.append(_line(name, tuple(sorted({**dict(labels), "replica": "all"}.items())), total))
    return "".join(lines)


def serve_aggregate(
    host: str,
    port: int,
    endpoints: Callable[[], dict[str, str]],
    extra: Callable[[], str] | None = None,
) -> Any:
    """An HTTP server answering ``/metrics`` with `aggregate` of every replica, then
    ``extra()`` (the gateway's own lines); returns it (``server_address[1]`` is the bound
    port; ``shutdown()`` stops it)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            text = aggregate(scrape_all(endpoints()))
            body = (text + (extra() if extra is not None else "")).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # scrapes are not worth a log line
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="cluster-metrics", daemon=True).start()
    return server
