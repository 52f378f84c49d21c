"""Adapter downloads follow redirects, and the key goes only to the endpoint's own origin:
a redirect to another host (object storage, say) gets the request without it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.http_files import QuietHandler
from vlm_server.models.lora.store import KEY_HEADER, AdapterStore

KEY = "secret-key"


class _Recorder(QuietHandler):
    seen: list[tuple[int, str, str | None]]  # (port, path, key header) per request
    routes: dict[str, str]  # path -> where it redirects

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        self.seen.append((port, self.path, self.headers.get(KEY_HEADER)))
        target = self.routes.get(self.path)
        if target is not None:
            self.send_response(302)
            self.send_header("Location", target)
            self.end_headers()
            return
        self.send_body(b"adapter bytes")


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"seen": [], "routes": {}})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield (*(f"http://127.0.0.1:{s.server_address[1]}" for s in servers), handler)
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()


Hosts = tuple[str, str, type[_Recorder]]


def test_a_redirect_to_another_host_goes_without_the_key(two_hosts: Hosts, tmp_path: Path) -> None:
    home, storage, handler = two_hosts
    handler.routes["/v1/variants/ft1/download"] = f"{storage}/bucket/ft1.pt"
    store = AdapterStore(tmp_path, home, api_key=KEY)
    path = store.download("ft1")
    assert path.read_bytes() == b"adapter bytes"
    assert [(p, k) for _, p, k in handler.seen] == [
        ("/v1/variants/ft1/download", KEY),
        ("/bucket/ft1.pt", None),
    ]


def test_a_redirect_within_the_endpoint_keeps_the_key(two_hosts: Hosts, tmp_path: Path) -> None:
    home, _, handler = two_hosts
    handler.routes["/v1/variants/ft2/download"] = f"{home}/v1/variants/ft2/v2"
    AdapterStore(tmp_path, home, api_key=KEY).download("ft2")
    assert [(p, k) for _, p, k in handler.seen] == [
        ("/v1/variants/ft2/download", KEY),
        ("/v1/variants/ft2/v2", KEY),
    ]
