"""Attention over the paged KV cache: a PyTorch path everywhere, Triton kernels on CUDA."""
