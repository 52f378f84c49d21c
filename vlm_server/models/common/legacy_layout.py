"""The legacy training layout's tensor names, both ways: Moondream 2's training checkpoints use
them, and Moondream 3's md3 layout for every tensor it shares with Moondream 2."""

from __future__ import annotations

import re

_V = "vision_encoder.encoder.model.visual."
_T = "text_model.transformer."

# (legacy pattern, native replacement); applied to the part of the key they match in full.
_LEGACY_RULES: tuple[tuple[str, str], ...] = (
    (re.escape(_V) + r"patch_embed\.linear\.(weight|bias)", r"vision.patch_emb.\1"),
    (re.escape(_V) + r"pos_embed", "vision.pos_emb"),
    (re.escape(_V) + r"blocks\.(\d+)\.norm1\.(weight|bias)", r"vision.blocks.\1.ln1.\2"),
    (re.escape(_V) + r"blocks\.(\d+)\.norm2\.(weight|bias)", r"vision.blocks.\1.ln2.\2"),
    (
        re.escape(_V) + r"blocks\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)",
        r"vision.blocks.\1.\2.\3",
    ),
    (re.escape(_V) + r"norm\.(weight|bias)", r"vision.post_ln.\1"),
    (r"vision_encoder\.projection\.mlp\.(fc1|fc2)\.(weight|bias)", r"vision.proj_mlp.\1.\2"),
    (re.escape(_T) + r"embd\.wte\.weight", "text.wte"),
    (re.escape(_T) + r"h\.(\d+)\.ln\.(weight|bias)", r"text.blocks.\1.ln.\2"),
    (re.escape(_T) + r"h\.(\d+)\.mixer\.Wqkv\.(weight|bias)", r"text.blocks.\1.attn.qkv.\2"),
    (re.escape(_T) + r"h\.(\d+)\.mixer\.out_proj\.(weight|bias)", r"text.blocks.\1.attn.proj.\2"),
    (re.escape(_T) + r"h\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"text.blocks.\1.mlp.\2.\3"),
    (r"text_model\.lm_head\.ln\.(weight|bias)", r"text.post_ln.\1"),
    (r"text_model\.lm_head\.linear\.(weight|bias)", r"text.lm_head.\1"),
    (r"region_model\.coordinate_encoder\.(weight|bias)", r"region.coord_encoder.\1"),
    (r"region_model\.coordinate_decoder\.(fc1|fc2)\.(weight|bias)", r"region.coord_decoder.\1.\2"),
    (r"region_model\.size_encoder\.(weight|bias)", r"region.size_encoder.\1"),
    (r"region_model\.size_decoder\.(fc1|fc2)\.(weight|bias)", r"region.size_decoder.\1.\2"),
    (r"region_model\.coordinate_features\.weight", "region.coord_features"),
    (r"region_model\.size_features\.weight", "region.size_features"),
)
_COMPILED = tuple((re.compile(p), r) for p, r in _LEGACY_RULES)


def legacy_to_native(key: str) -> str | None:
    """Native name for a legacy key, or None when no rule matches."""
    key = key.replace("._orig_mod", "").removeprefix("_orig_mod.")
    for pattern, repl in _COMPILED:
        if pattern.fullmatch(key):
            return pattern.sub(repl, key)
    return None


def native_to_legacy(key: str) -> str:
    """Legacy name for a native key (used to write legacy checkpoints for tests)."""
    for legacy, native in _LEGACY_NAMES:
        m = re.fullmatch(native, key)
        if m:
            return m.expand(legacy)
    raise KeyError(key)


# Inverse rules, written out rather than derived so each direction reads plainly.
_LEGACY_NAMES: tuple[tuple[str, str], ...] = (
    (_V + r"patch_embed.linear.\1", r"vision\.patch_emb\.(weight|bias)"),
    (_V + "pos_embed", r"vision\.pos_emb"),
    (_V + r"blocks.\1.norm1.\2", r"vision\.blocks\.(\d+)\.ln1\.(weight|bias)"),
    (_V + r"blocks.\1.norm2.\2", r"vision\.blocks\.(\d+)\.ln2\.(weight|bias)"),
    (
        _V + r"blocks.\1.\2.\3",
        r"vision\.blocks\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)",
    ),
    (_V + r"norm.\1", r"vision\.post_ln\.(weight|bias)"),
    (r"vision_encoder.projection.mlp.\1.\2", r"vision\.proj_mlp\.(fc1|fc2)\.(weight|bias)"),
    (_T + "embd.wte.weight", r"text\.wte"),
    (_T + r"h.\1.ln.\2", r"text\.blocks\.(\d+)\.ln\.(weight|bias)"),
    (_T + r"h.\1.mixer.Wqkv.\2", r"text\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)"),
    (_T + r"h.\1.mixer.out_proj.\2", r"text\.blocks\.(\d+)\.attn\.proj\.(weight|bias)"),
    (_T + r"h.\1.mlp.\2.\3", r"text\.blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)"),
    (r"text_model.lm_head.ln.\1", r"text\.post_ln\.(weight|bias)"),
    (r"text_model.lm_head.linear.\1", r"text\.lm_head\.(weight|bias)"),
    (r"region_model.coordinate_encoder.\1", r"region\.coord_encoder\.(weight|bias)"),
    (r"region_model.coordinate_decoder.\1.\2", r"region\.coord_decoder\.(fc1|fc2)\.(weight|bias)"),
    (r"region_model.size_encoder.\1", r"region\.size_encoder\.(weight|bias)"),
    (r"region_model.size_decoder.\1.\2", r"region\.size_decoder\.(fc1|fc2)\.(weight|bias)"),
    ("region_model.coordinate_features.weight", r"region\.coord_features"),
    ("region_model.size_features.weight", r"region\.size_features"),
)
