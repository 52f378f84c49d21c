"""The engine: what the gRPC service submits requests to."""
