"""Generated from protos/vlm/v1 (python -m vlm_server.service.codegen)."""
