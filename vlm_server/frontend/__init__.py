"""The request path both front doors (vlm_server.rpc, vlm_server.http) share.

A door turns its wire format into the API's proto request messages; from there every request
takes the same path: admission, the same checks and limits, the same image handling, the same
metrics and access log. Turning an error into a status is the door's job.

Map:
  calls            `ServiceCore` (the engine, drain gates, limits) and `Call` (one request's
                   admission, timing, running, metrics and access-log line)
  request_builder  proto request -> engine request: the one validation both doors go through
  validation       field checks that need no model; errors name the proto field
  images           image decoding in a thread pool; the image LRU cache with per-client shares
  refusals         the errors a request gets (invalid, unavailable), naming proto fields
  metrics          Prometheus metrics on a private registry and their HTTP endpoint
  logs             key=value or JSON log lines; one access-log line per request
  phase            the server's phase (loading ... stopped), which both doors' health reports read
"""
