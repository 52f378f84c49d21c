"""Server reflection under both of its names: ``grpc.reflection.v1`` (what current grpcurl and
Postman ask first) and ``grpc.reflection.v1alpha`` (older tools).

grpcio-reflection implements v1alpha only. The two versions' messages are the same on the
wire (same fields, same numbers; only the package differs), so one servicer answers both: v1
calls are routed to it with v1alpha's (de)serializers. So that ``describe`` works on the v1
service too, its file descriptor (v1alpha's with the package renamed) joins the default pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA = reflection.SERVICE_NAME
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    """Add the v1 reflection file to the default descriptor pool (once)."""
    pool = descriptor_pool.Default()
    with contextlib.suppress(KeyError):
        pool.FindFileByName(_V1_FILE)
        return
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = proto.package, "grpc.reflection.v1"
    proto.name, proto.package = _V1_FILE, new
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(f".{old}."):
                field.type_name = f".{new}." + field.type_name[len(old) + 2 :]
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    with contextlib.suppress(TypeError):  # another copy got there first
        pool.Add(proto)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection (v1 and v1alpha) for ``service_names`` and for itself."""
    _register_v1_descriptor()
    names = (*service_names, V1, V1ALPHA)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)  # v1alpha, with a servicer of its own
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": handler}),)
    )
