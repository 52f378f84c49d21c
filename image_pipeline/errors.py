"""Typed errors for image input problems.

Every problem caused by the *content* of an uploaded image is reported as an
:class:`ImageError`, so the server can map it to a client error (gRPC
``INVALID_ARGUMENT``) instead of an internal failure.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ImageError", "ImageErrorReason"]


class ImageErrorReason(StrEnum):
    """Why an image was refused. Values are stable strings, safe to send to clients."""

    EMPTY = "empty"
    TOO_LARGE_BYTES = "too_large_bytes"
    TOO_MANY_PIXELS = "too_many_pixels"
    TOO_LARGE_SIDE = "too_large_side"
    TOO_SMALL = "too_small"
    UNSUPPORTED_FORMAT = "unsupported_format"
    UNSUPPORTED_MODE = "unsupported_mode"
    CORRUPT = "corrupt"
    TOO_COMPRESSED = "too_compressed"
    OVER_DECODE_BUDGET = "over_decode_budget"


class ImageError(Exception):
    """An image could not be accepted; ``reason`` says why, ``message`` says it for humans."""

    def __init__(self, reason: ImageErrorReason, message: str) -> None:
        super().__init__(message)
        self.reason = ImageErrorReason(reason)
        self.message = message

    def __repr__(self) -> str:
        return f"ImageError({self.reason.value!r}, {self.message!r})"

    # The default Exception pickling would call cls(message) and lose the reason;
    # errors may cross process boundaries (process pools), so keep both.
    def __reduce__(self) -> tuple[type[ImageError], tuple[ImageErrorReason, str]]:
        return (type(self), (self.reason, self.message))
