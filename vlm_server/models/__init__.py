"""Model families and the seam the engine is typed against.

- ``interface``: protocols of what the engine needs (`DeviceModel`, `FamilyConfig`), `KVShape`,
  `LoadedModel`.
- ``contract``: the tokenizer contract (special ids, prompt templates, value scales).
- ``prompts``: prompt token ids from a contract's templates.
- ``kv``: the KV-cache protocol a decoder writes through; the reference's dense cache.
- ``checkpoint_io``, ``hub``: reading checkpoint files and sources, for every family.
- ``registry``: the families; presets, checkpoints and random models resolved to their family.
- ``common``: building blocks families share (norms, MLP, rotary).
- ``moondream2``: the Moondream 2 family.
- ``moondream3``: the Moondream 3 family (mixture-of-experts decoder, Moondream 2's vision).
"""
