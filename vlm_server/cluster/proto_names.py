"""The API's messages under the module name their descriptors give (``vlm.v1...``).

Ray Serve's proxies pickle request and response messages, and pickle finds a class by its
``__module__``: the generated code names ``vlm.v1.vision_language_pb2`` (the proto's package),
which is `vlm_server.api.v1.vision_language_pb2` here. Registering that name in every process
that pickles or unpickles them (proxies, routers, replicas) makes the classes findable. The
proxies import `add_servicer` (grpc_servicer_functions), so they register it too.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from vlm_server.api.v1 import vision_language_pb2, vision_language_pb2_grpc

_NAME = "vlm.v1.vision_language_pb2"


def register() -> None:
    """Make ``vlm.v1.vision_language_pb2`` importable (as this project's module); idempotent."""
    if _NAME in sys.modules:
        return
    top = sys.modules.get("vlm") or types.ModuleType("vlm")
    v1 = sys.modules.get("vlm.v1") or types.ModuleType("vlm.v1")
    top.v1 = v1  # type: ignore[attr-defined]
    v1.vision_language_pb2 = vision_language_pb2  # type: ignore[attr-defined]
    sys.modules.setdefault("vlm", top)
    sys.modules.setdefault("vlm.v1", v1)
    sys.modules[_NAME] = vision_language_pb2


def add_servicer(servicer: Any, server: Any) -> None:
    """What Ray Serve's gRPC proxy calls to learn the services (``grpc_servicer_functions``):
    the API, and ``grpc.health.v1.Health/Check`` (answered by a replica, for load balancers
    that speak gRPC health)."""
    from grpc_health.v1 import health_pb2_grpc

    register()
    vision_language_pb2_grpc.add_VisionLanguageServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


register()
