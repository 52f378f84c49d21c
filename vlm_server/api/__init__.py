"""Generated gRPC code (python -m vlm_server.service.codegen). Do not edit."""
