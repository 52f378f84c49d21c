"""Finetune adapters: LoRA on a family's text decoder (files, stacked device weights, math)."""
