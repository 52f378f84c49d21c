"""A base for the tests' small local HTTP servers (adapter downloads): answers with a body,
and no log line per request."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler


class QuietHandler(BaseHTTPRequestHandler):
    def send_body(self, body: bytes) -> None:
        """200 with ``body``."""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass
