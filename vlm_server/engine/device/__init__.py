"""The engine's device side: the model runtime (slots, streams, graphs) and its kernels."""
