"""Weight-only quantization: the INT8 and INT4 formats, and the quantized safetensors files."""
