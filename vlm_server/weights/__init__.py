"""Checkpoint layouts, loading, writing and tokenizer construction."""
