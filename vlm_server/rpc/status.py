"""Engine errors as gRPC sees them: status codes, and the trailing-metadata keys that carry
the field at fault and the request id."""

from __future__ import annotations

import grpc

from vlm_server.engine.api import ErrorCode

FIELD_METADATA_KEY = "vlm-field"
REQUEST_ID_METADATA_KEY = "vlm-request-id"

STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}
