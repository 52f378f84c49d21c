"""The gRPC door: the service ``vlm.v1.VisionLanguage`` over the shared request path.

Map:
  servicer   one handler per RPC: the gRPC side of a call, engine events -> messages
  responses  engine results -> proto response messages
  status     engine error codes -> gRPC status codes; trailing-metadata keys
  intake     before a handler runs: unparsable requests -> INVALID_ARGUMENT naming the field;
             calls that end before their handler are still counted
  auth       API keys (`ApiKeys`, which the server hands the HTTP door too), the
             UNAUTHENTICATED interceptor, client identity for per-client limits
  health     grpc.health.v1 liveness ("") and readiness (the service name)
  codegen    regenerates vlm_server/api from protos/
"""
