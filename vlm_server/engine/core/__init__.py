"""The engine's CUDA-free core: scheduler, pipeline state, sequences, KV pages, prefix cache.

Nothing here imports torch or the model (a test proves it): the core runs against the
`Runtime` protocol, so every transition is tested on the CPU without a device.
"""
