"""Building blocks the families share: LayerNorm and MLP, rotary tables, fused add + norm."""
