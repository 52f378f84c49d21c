"""Moondream 2: config and presets, modules (vision, text, region), checkpoint layouts, loader,
writer and tokenizer; ``family`` is its entry in the registry."""
