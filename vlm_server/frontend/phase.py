"""The server's phase (loading, serving, draining, failed, stopped), which both doors report.

The gRPC door reports it through grpc.health.v1 (vlm_server.rpc.health), the HTTP door through
``/health`` and ``/ready``; the server assembly moves it. Liveness holds while loading, serving
and draining; readiness only while serving.
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["loading", "serving", "draining", "failed", "stopped"]
PHASES: tuple[Phase, ...] = ("loading", "serving", "draining", "failed", "stopped")


class ServerPhase:
    """Where the server is in its life; a door reads it, the server assembly sets it."""

    def __init__(self) -> None:
        self.phase: Phase = "loading"

    @property
    def live(self) -> bool:
        """Whether the process can still serve (else: restart it)."""
        return self.phase in ("loading", "serving", "draining")

    @property
    def ready(self) -> bool:
        """Whether to send it work."""
        return self.phase == "serving"
