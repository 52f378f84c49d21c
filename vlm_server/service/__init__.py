"""The gRPC service ``vlm.v1.VisionLanguage`` in front of any `Engine`.

Map:
  main        ``vlm-server``: flags -> config -> engine factory -> server; SIGTERM drains
  config      flags and VLM_* environment variables
  server      grpc.aio server: servicer, health, reflection, metrics; start / drain / stop
  servicer    one handler per RPC: validation, image lookup, engine events -> messages
  validation  field checks that need no model; errors name the proto field
  images      image decoding in a thread pool; the EncodeImage LRU cache
  convert     engine results -> proto messages
  errors      engine error codes -> gRPC status codes, field names
  health      grpc.health.v1 liveness ("") and readiness (the service name)
  metrics     Prometheus metrics on a private registry and their HTTP endpoint
  logs        key=value or JSON log lines; one access-log line per request
  codegen     regenerates vlm_server/api from protos/
  testing     in-process server thread, a holdable reference engine, a poll helper
"""
