"""The engine in its own process: the server keeps gRPC, HTTP and image preparation, and the
scheduler thread gets an interpreter (and a GIL) of its own."""
