"""The gRPC service ``vlm.v1.VisionLanguage`` in front of any `Engine`.

Map:
  main        ``vlm-server``: flags -> config -> engine factory -> server; SIGTERM drains
  config      flags and VLM_* environment variables
  server      grpc.aio server (and the HTTP door, vlm_server.http): servicer, health,
              reflection, metrics; start / drain / stop
  calls       what every front door shares: the engine, drain gates, one request's admission,
              metrics (labelled by door) and access log
  servicer    one handler per RPC: the gRPC side of a call, engine events -> messages
  requests    proto request -> engine request: the one validation both doors go through
  intake      before a handler runs: unparsable requests -> INVALID_ARGUMENT naming the
              field; calls that end before their handler are still counted
  auth        API keys (`ApiKeys`, shared by both doors), the UNAUTHENTICATED interceptor,
              client identity for per-client limits
  validation  field checks that need no model; errors name the proto field
  images      image decoding in a thread pool; the image LRU cache with per-client shares
  convert     engine results -> proto messages
  errors      engine error codes -> gRPC status codes, field names
  health      grpc.health.v1 liveness ("") and readiness (the service name)
  metrics     Prometheus metrics on a private registry and their HTTP endpoint
  logs        key=value or JSON log lines; one access-log line per request
  memory      glibc malloc settings, cycle collection and heap trimming under load
  codegen     regenerates vlm_server/api from protos/
  testing     in-process server thread, a holdable reference engine, a poll helper
"""
