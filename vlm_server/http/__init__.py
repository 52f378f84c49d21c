"""The HTTP door: Moondream's API and an OpenAI-compatible chat endpoint, on its own port, in
the same event loop and in front of the same engine, validation and image cache as gRPC.

Map, in request order:
  server     aiohttp app: auth, deadline header, admission through the shared `Call`, errors
  routes     the route table (what is served and described)
  exchange   one request: its body, its call, JSON answers and event streams, error answers
  body       body size limit, JSON parsing, declared field shapes (also the OpenAPI schemas)
  data_url   base64 data URLs -> image bytes (remote URLs are refused)
  moondream  /v1/caption, /v1/query, /v1/point, /v1/detect, /v1/segment
  chat       /v1/chat/completions and /v1/models (OpenAI-compatible)
  errors     status codes from the service's codes; the JSON error object; field renaming
  openapi    the OpenAPI document generated from the route table
"""
