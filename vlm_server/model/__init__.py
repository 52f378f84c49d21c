"""Moondream 2 compatible model: vision encoder, Phi-style text decoder, region heads."""

from vlm_server.model.moondream import MoondreamModel

__all__ = ["MoondreamModel"]
