"""The server process: both doors over one engine, and what the process itself needs.

Map:
  main        ``vlm-server`` (and ``vlm serve``): options -> engine factory -> server; SIGTERM
              drains
  lifecycle   `VisionLanguageServer`: the gRPC door (vlm_server.rpc) and the HTTP door
              (vlm_server.http) on one engine; health, reflection, metrics; start / drain / stop
  service     the service core (image cache, image resolver, limits) around one engine, which
              `vlm batch` builds too, with no doors
  engines     the engines by name (``--engine``), the model loader, and whether the engine runs
              in a process of its own (``--engine-process``)
  memory      glibc malloc settings, cycle collection and heap trimming under load
"""
