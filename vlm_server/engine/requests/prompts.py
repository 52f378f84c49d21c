"""Prompt token ids for each task, from the token contract's templates."""

from __future__ import annotations

from tokenizers import Tokenizer

from vlm_server.config import TokenContract


def caption_prompt(contract: TokenContract, length: str) -> list[int]:
    return list(contract.templates.caption(length))


def query_prompt(contract: TokenContract, tokenizer: Tokenizer, question: str) -> list[int]:
    t = contract.templates
    text = (" " + question) if t.question_leading_space else question
    return [*t.query_prefix, *tokenizer.encode(text).ids, *t.query_suffix]


def _object_prompt(
    prefix: tuple[int, ...],
    suffix: tuple[int, ...],
    leading_space: bool,
    tokenizer: Tokenizer,
    obj: str,
) -> list[int]:
    text = (" " + obj) if leading_space else obj
    return [*prefix, *tokenizer.encode(text).ids, *suffix]


def detect_prompt(contract: TokenContract, tokenizer: Tokenizer, obj: str) -> list[int]:
    t = contract.templates
    return _object_prompt(t.detect_prefix, t.detect_suffix, t.object_leading_space, tokenizer, obj)


def point_prompt(contract: TokenContract, tokenizer: Tokenizer, obj: str) -> list[int]:
    t = contract.templates
    return _object_prompt(t.point_prefix, t.point_suffix, t.object_leading_space, tokenizer, obj)


def segment_prompt(contract: TokenContract, tokenizer: Tokenizer, obj: str) -> list[int]:
    t = contract.templates
    if t.segment_prefix is None or t.segment_suffix is None:
        raise ValueError(f"token contract {contract.name!r} defines no segment template")
    return _object_prompt(
        t.segment_prefix, t.segment_suffix, t.object_leading_space, tokenizer, obj
    )
