"""The gRPC service ``vlm.v1.VisionLanguage`` in front of any `Engine`.

Map:
  main        ``vlm-server``: flags -> config -> engine factory -> server; SIGTERM drains
  config      flags and VLM_* environment variables
  server      grpc.aio server: servicer, health, reflection, metrics, TLS; start / drain /
              stop; a taken port is a one-line `ListenError`
  intake      before a handler runs: unparsable requests -> INVALID_ARGUMENT naming the
              field; calls that end before their handler are still counted
  auth        API keys (`ApiKeys`, shared with other front doors), the UNAUTHENTICATED
              interceptor, client identity for per-client limits
  servicer    one handler per RPC: validation, image lookup, engine events -> messages
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
