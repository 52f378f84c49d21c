"""Checkpoint directories whose config.json is in the moondream reference's own format, and
whose tokenizer.json uses a decoder without an exact byte mapping."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.common.contracts import TINY_SPECIAL_TOKENS
from vlm_server.models.moondream2.config import preset
from vlm_server.models.moondream2.loader import load_model, read_config
from vlm_server.models.moondream2.reference_config import from_moondream_dict
from vlm_server.reference import ReferenceGenerator, SamplingSettings


def _tiny_reference_format() -> dict:
    """The tiny preset written the way the reference writes its config.json."""
    cfg = preset("tiny")
    t, v, r, c = cfg.text, cfg.vision, cfg.region, cfg.tokens
    assert c is not None
    tpl = c.templates
    return {
        "text": {
            "dim": t.dim,
            "ff_dim": t.ff_dim,
            "n_layers": t.n_layers,
            "vocab_size": t.vocab_size,
            "max_context": t.max_context,
            "n_heads": t.n_heads,
            "n_kv_heads": t.n_kv_heads,
            "prefix_attn": cfg.image_prefix_len,
        },
        "vision": {
            "enc_dim": v.enc_dim,
            "enc_patch_size": v.patch_size,
            "enc_n_layers": v.enc_n_layers,
            "enc_ff_dim": v.enc_ff_dim,
            "enc_n_heads": v.enc_n_heads,
            "proj_out_dim": v.proj_out_dim,
            "proj_inner_dim": v.proj_inner_dim,
        },
        "region": {
            "dim": r.dim,
            "coord_feat_dim": r.coord_feat_dim,
            "size_feat_dim": r.size_feat_dim,
            "inner_dim": r.inner_dim,
        },
        "tokenizer": {
            "bos_id": c.bos_id,
            "eos_id": c.eos_id,
            "templates": {
                "caption": {
                    "short": list(tpl.caption_short),
                    "normal": list(tpl.caption_normal),
                    "long": list(tpl.caption_long),
                },
                "query": {"prefix": list(tpl.query_prefix), "suffix": [3]},
                "detect": {"prefix": list(tpl.detect_prefix), "suffix": list(tpl.detect_suffix)},
                "point": {"prefix": list(tpl.point_prefix), "suffix": list(tpl.point_suffix)},
            },
        },
    }


def test_reference_format_config_loads(tmp_path: Path, tiny_dir: Path) -> None:
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(_tiny_reference_format()))
    want = preset("tiny")
    got = read_config(tmp_path, None)
    assert (got.text, got.vision, got.region) == (want.text, want.vision, want.region)
    assert got.tokens.templates.query_suffix == (3, 3)  # the 2025-06 code appends it twice
    assert (got.tokens.eos_id, got.tokens.coord_id, got.tokens.decode_suppressed_ids) == (
        0,
        5,
        (3,),
    )
    loaded = load_model(tmp_path, dtype=torch.float32, progress=False)
    assert loaded.config.text == want.text


def test_gpt2_era_reference_config() -> None:
    data = _tiny_reference_format()
    data["text"]["vocab_size"] = 51200
    data["tokenizer"] = {
        "bos_id": 50256,
        "eos_id": 50256,
        "templates": {
            "caption": {
                "short": [198, 198, 16438, 8305, 25],
                "normal": [198, 198, 24334, 1159, 25],
            },
            "query": {"prefix": [198, 198, 24361, 25], "suffix": [198, 198, 33706, 25]},
            "detect": {"prefix": [198, 198, 47504, 25], "suffix": [628]},
            "point": {"prefix": [198, 198, 12727, 25], "suffix": [628]},
        },
    }
    cfg = from_moondream_dict(data)
    tokens = cfg.tokens
    assert (tokens.bos_id, tokens.eos_id, tokens.coord_id) == (50256, 50256, None)
    assert tokens.templates.query_suffix == (198, 198, 33706, 25)  # appended once in that era
    assert tokens.templates.question_leading_space and not tokens.decode_suppressed_ids
    assert tokens.templates.caption_long == (198, 198, 14617, 8305, 25)  # not in the file
    assert from_moondream_dict(data, "moondream2-2025-04-14").tokens.size_scale == "log"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["text"].update(n_experts=4), "n_experts"),
        (lambda d: d["text"].update(group_size=128), "int4"),
        (lambda d: d["text"].update(prefix_attn=5), "prefix_attn"),
        (lambda d: d["region"].update(dim=32), "region dim"),
    ],
)
def test_bad_reference_configs_are_named(change, message: str) -> None:
    data = _tiny_reference_format()
    change(data)
    with pytest.raises(CheckpointError, match=message):
        from_moondream_dict(data)


def test_tokenizer_with_a_wordpiece_decoder_serves_constraints(
    tmp_path: Path, tiny_dir: Path
) -> None:
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["is there a red car or a blue bus here", "yes no maybe the dog sits"] * 30
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=[*TINY_SPECIAL_TOKENS, "[UNK]"]
    )
    tok.train_from_iterator(corpus, trainer)
    tok.decoder = decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_model(tmp_path, dtype=torch.float32, progress=False)
    gen = ReferenceGenerator(loaded.model, loaded.tokenizer)
    choices = (" red car", " blue bus")
    for seed in range(3):
        s = SamplingSettings(temperature=1.0, seed=seed, max_tokens=10)
        r = gen.query(None, "which one?", s, choices=choices)
        assert r.text.strip() in ("red car", "blue bus")
        assert r.text == loaded.tokenizer.decode(r.token_ids)


def test_reference_defaults_are_the_current_moondream2() -> None:
    got, want = from_moondream_dict({"text": {}}), preset("moondream2")
    assert (got.text, got.vision, got.region) == (want.text, want.vision, want.region)
    assert got.tokens.templates == want.tokens.templates
    assert got.tokens.decode_suppressed_ids == want.tokens.decode_suppressed_ids == (3,)
