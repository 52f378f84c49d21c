"""Generated from protos/vlm/v1 by vlm_server.rpc.codegen."""
