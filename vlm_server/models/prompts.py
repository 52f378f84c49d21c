"""Prompt token ids for each task, from the token contract's templates."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer

from vlm_server.models.contract import TokenContract


class TemplateMissing(ValueError):
    """The token contract has no template for what was asked: a task or mode its family
    does not have (a server refuses such a request as unimplemented, not as bad input)."""


# What turns a client's text (a question, an object name) into token ids.
Encode = Callable[[str], Sequence[int]]


class CachedEncoder:
    """Token ids of clients' texts, the most recent ``entries`` cached: the same question or
    object name comes back over many pictures, and encoding one costs a few hundred
    microseconds on every request's way to the scheduler."""

    def __init__(self, tokenizer: Tokenizer, entries: int = 1024) -> None:
        self.tokenizer = tokenizer
        self._ids = functools.lru_cache(maxsize=entries)(self._encode)

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text).ids)

    def __call__(self, text: str) -> tuple[int, ...]:
        return self._ids(text)


def caption_prompt(contract: TokenContract, length: str) -> list[int]:
    return list(contract.templates.caption(length))


USER, ASSISTANT = "user", "assistant"  # the roles of a chat's earlier turns


def query_prompt(
    contract: TokenContract,
    encode: Encode,
    question: str,
    refs: Sequence[int] = (),
    reasoning: bool = False,
    history: Sequence[tuple[str, str]] = (),
) -> list[int]:
    """Prefix, spatial-reference positions, the question, then the answer suffix (or, with
    ``reasoning``, the reasoning suffix: the answer then comes after the reasoning).

    ``history``: a chat's earlier turns, (role, text), rendered first as the model's author
    renders a conversation (the model has no multi-turn format of its own): a user turn as a
    query's prefix and question, an assistant turn as the answer suffix and its text."""
    t = contract.templates
    if reasoning:
        if t.reasoning_suffix is None:
            raise TemplateMissing(f"token contract {contract.name!r} has no reasoning mode")
        suffix = t.reasoning_suffix
    else:
        suffix = t.query_suffix
    out: list[int] = []
    for role, said in history:
        if role == USER:
            out += [*t.query_prefix, *encode(_question(t.question_leading_space, said))]
        elif role == ASSISTANT:
            out += [*t.query_suffix, *encode(said)]
        else:
            raise ValueError(f"a chat turn's role is user or assistant, got {role!r}")
    text = _question(t.question_leading_space, question)
    return [*out, *t.query_prefix, *refs, *encode(text), *suffix]


def _question(leading_space: bool, text: str) -> str:
    return " " + text if leading_space and text else text


def _object_prompt(
    prefix: tuple[int, ...],
    suffix: tuple[int, ...],
    leading_space: bool,
    encode: Encode,
    obj: str,
    refs: Sequence[int],
) -> list[int]:
    text = (" " + obj) if leading_space else obj
    return [*prefix, *refs, *encode(text), *suffix]


def detect_prompt(
    contract: TokenContract, encode: Encode, obj: str, refs: Sequence[int] = ()
) -> list[int]:
    t = contract.templates
    return _object_prompt(
        t.detect_prefix, t.detect_suffix, t.object_leading_space, encode, obj, refs
    )


def point_prompt(
    contract: TokenContract, encode: Encode, obj: str, refs: Sequence[int] = ()
) -> list[int]:
    t = contract.templates
    return _object_prompt(t.point_prefix, t.point_suffix, t.object_leading_space, encode, obj, refs)


def segment_prompt(
    contract: TokenContract, encode: Encode, obj: str, refs: Sequence[int] = ()
) -> list[int]:
    t = contract.templates
    if t.segment_prefix is None or t.segment_suffix is None:
        raise TemplateMissing(f"token contract {contract.name!r} defines no segment template")
    return _object_prompt(
        t.segment_prefix, t.segment_suffix, t.segment_object_leading_space, encode, obj, refs
    )
