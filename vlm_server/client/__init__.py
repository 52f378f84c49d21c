"""Client of the ``vlm.v1.VisionLanguage`` gRPC service (sync and asyncio) and ``vlm-client``.

from vlm_server.client import VisionLanguageClient

with VisionLanguageClient("localhost:50051") as client:
    print(client.caption("photo.jpg").text)
    boxes = client.detect("photo.jpg", "car").boxes  # normalized; may pass the edges
"""

from vlm_server.client.aio import AsyncVisionLanguageClient
from vlm_server.client.convert import ImageInput, Settings
from vlm_server.client.security import Security
from vlm_server.client.sync import VisionLanguageClient
from vlm_server.client.types import (
    Box,
    DetectResult,
    EncodedImage,
    Metrics,
    ModelInfo,
    Point,
    PointResult,
    RleMask,
    SegmentResult,
    TextDelta,
    TextResult,
    VlmError,
)

__all__ = [
    "AsyncVisionLanguageClient",
    "Box",
    "DetectResult",
    "EncodedImage",
    "ImageInput",
    "Metrics",
    "ModelInfo",
    "Point",
    "PointResult",
    "RleMask",
    "Security",
    "SegmentResult",
    "Settings",
    "TextDelta",
    "TextResult",
    "VisionLanguageClient",
    "VlmError",
]
