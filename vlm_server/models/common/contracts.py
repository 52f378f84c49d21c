"""Token contracts more than one family speaks: the project's tiny test vocabulary (Moondream 2's
``tiny``, Moondream 3's ``md3-tiny`` and test families build on it), and the GPT-2 era's
end-of-text id the synthetic tokenizer reserves."""

from __future__ import annotations

from vlm_server.models.contract import PromptTemplates, TokenContract

GPT2_EOS = 50256

# The tiny vocabulary's special tokens, in id order. The first ten mirror the 2025-06 layout.
TINY_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|open|>",
    "<|close|>",
    "<|answer|>",
    "<|thinking|>",
    "<|coord|>",
    "<|size|>",
    "<|start_ground_points|>",
    "<|start_ground_text|>",
    "<|end_ground|>",
    "<|caption|>",
    "<|short|>",
    "<|normal|>",
    "<|long|>",
    "<|query|>",
    "<|detect|>",
    "<|point|>",
    "<|segment|>",
)
_TINY = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}

CONTRACT_TINY = TokenContract(
    name="tiny",
    bos_id=0,
    eos_id=0,
    templates=PromptTemplates(
        caption_short=(1, _TINY["<|caption|>"], 2, _TINY["<|short|>"], 3),
        caption_normal=(1, _TINY["<|caption|>"], 2, _TINY["<|normal|>"], 3),
        caption_long=(1, _TINY["<|caption|>"], 2, _TINY["<|long|>"], 3),
        query_prefix=(1, _TINY["<|query|>"], 2),
        query_suffix=(3,),
        detect_prefix=(1, _TINY["<|detect|>"], 2),
        detect_suffix=(3,),
        point_prefix=(1, _TINY["<|point|>"], 2),
        point_suffix=(3,),
        segment_prefix=(1, _TINY["<|segment|>"], 2),
        segment_suffix=(3,),
        reasoning_suffix=(3, _TINY["<|thinking|>"]),
        question_leading_space=False,
        object_leading_space=True,
    ),
    size_scale="log",
    coord_id=5,
    size_id=6,
    answer_id=3,
    decode_suppressed_ids=(3,),
    thinking_id=_TINY["<|thinking|>"],
    start_ground_points_id=_TINY["<|start_ground_points|>"],
    end_ground_id=_TINY["<|end_ground|>"],
)
