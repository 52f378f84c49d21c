"""Generated from protos/vlm/v1 by vlm_server.service.codegen."""
