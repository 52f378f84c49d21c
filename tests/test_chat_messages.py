"""A chat's messages as one query: the conversation's reading (system fold, turns, the one
picture, errors naming the JSON path) and its prompt, token by token, in the layout of the
model author's engine: each user turn a query block, each assistant turn the answer suffix
and its text, the last user turn ending with the answer (or reasoning) suffix."""

from __future__ import annotations

from typing import Any

import pytest

from vlm_server.engine.api import EngineError
from vlm_server.http.chat_messages import read
from vlm_server.models import prompts
from vlm_server.models.common.contracts import CONTRACT_TINY
from vlm_server.models.moondream2.config import CONTRACT_GPT2_LINEAR

IMG = "data:image/jpeg;base64,AAAA"


def _encode(text: str) -> tuple[int, ...]:
    """A stand-in tokenizer: one id per character, far from the template ids."""
    return tuple(1000 + ord(c) for c in text)


def _picture(url: str = IMG) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_the_system_text_folds_into_the_first_user_turn_and_turns_keep_their_order() -> None:
    chat = read(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Be kind."}]},
            {"role": "user", "content": [{"type": "text", "text": "what"}, _picture()]},
            {"role": "assistant", "content": "a cat", "refusal": None, "tool_calls": []},
            {
                "role": "user",
                "content": [{"type": "text", "text": "its "}, {"type": "text", "text": "colour?"}],
            },
        ]
    )
    assert chat.history == (("user", "Be brief.\n\nBe kind.\n\nwhat"), ("assistant", "a cat"))
    assert chat.question == "its colour?"  # text parts concatenated as sent
    assert chat.question_field == "messages[4].content"
    assert chat.picture is not None and chat.picture.field == "messages[2].content[1].image_url.url"
    assert chat.chars == len("Be brief.\n\nBe kind.\n\nwhat") + len("a cat") + len("its colour?")


def test_one_user_turn_is_the_query_of_before() -> None:
    chat = read([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert chat.history == () and chat.question == "Be brief.\n\nhi" and chat.picture is None
    # A picture-only question takes the system text alone, as the author's engine does.
    alone = read(
        [{"role": "system", "content": "Describe."}, {"role": "user", "content": [_picture()]}]
    )
    assert alone.question == "Describe." and alone.picture is not None


def test_the_system_text_waits_for_a_user_turn_and_an_echoed_reply_is_read() -> None:
    chat = read(
        [
            {"role": "system", "content": "S"},
            {"role": "assistant", "content": None, "reasoning_content": "thought"},
            {"role": "user", "content": "q1"},
            {"role": "user", "content": "q2"},
        ]
    )
    assert chat.history == (("assistant", ""), ("user", "S\n\nq1")) and chat.question == "q2"


def _m(role: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


U, A = "user", "assistant"
BAD: list[tuple[str, list[Any], str]] = [
    ("empty", [], "messages"),
    ("an unknown role", [_m("moderator", "x")], "messages[0].role"),
    ("a tool turn", [_m(U, "x"), _m("tool", "4")], "messages[1].role"),
    ("ends with the assistant", [_m(U, "x"), _m(A, "y")], "messages[1].role"),
    ("only a system message", [_m("system", "x")], "messages[0].role"),
    (
        "a late system message",
        [_m(U, "x"), _m(A, "y"), _m("system", "z"), _m(U, "w")],
        "messages[2].role",
    ),
    ("a user turn without content", [{"role": U}], "messages[0].content"),
    (
        "two pictures in two turns",
        [_m("system", "s"), _m(U, [_picture()]), _m(A, "a"), _m(U, [_text("and?"), _picture()])],
        "messages[3].content[1]",
    ),
    ("two pictures in one turn", [_m(U, [_picture(), _picture()])], "messages[0].content[1]"),
    (
        "a picture in an assistant turn",
        [_m(U, "x"), _m(A, [_picture()]), _m(U, "y")],
        "messages[1].content[0]",
    ),
    (
        "a picture in a system message",
        [_m("system", [_picture()]), _m(U, "y")],
        "messages[0].content[0]",
    ),
    (
        "a tool call",
        [_m(U, "x"), _m(A, "", tool_calls=[{"id": "1"}]), _m(U, "y")],
        "messages[1].tool_calls",
    ),
    ("an audio part", [_m(U, [{"type": "input_audio"}])], "messages[0].content[0].type"),
    ("a number as content", [_m(U, 3)], "messages[0].content"),
    ("too many messages", [_m(U, "x")] * 513, "messages"),
]


@pytest.mark.parametrize(("case", "messages", "field"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_conversation_names_the_field(case: str, messages: list[Any], field: str) -> None:
    with pytest.raises(EngineError) as err:
        read(messages)
    assert err.value.field == field, err.value.message


def test_the_prompt_is_a_run_of_query_blocks() -> None:
    c = CONTRACT_TINY
    t = c.templates
    history = (("user", "S\n\nwhat"), ("assistant", "a cat"), ("user", "and"))
    got = prompts.query_prompt(c, _encode, "its colour?", (), False, history)
    want = [
        *t.query_prefix, *_encode("S\n\nwhat"), *t.query_suffix, *_encode("a cat"),
        *t.query_prefix, *_encode("and"),
        *t.query_prefix, *_encode("its colour?"), *t.query_suffix,
    ]  # fmt: skip
    assert got == want
    # Reasoning opens only the last turn; earlier answers keep the answer suffix.
    assert t.reasoning_suffix is not None
    thinking = prompts.query_prompt(c, _encode, "its colour?", (), True, history)
    assert thinking == [*want[: -len(t.query_suffix)], *t.reasoning_suffix]
    # No history: the query prompt of before.
    assert prompts.query_prompt(c, _encode, "q") == [
        *t.query_prefix,
        *_encode("q"),
        *t.query_suffix,
    ]


def test_a_contract_with_a_leading_space_gives_it_to_every_user_turn() -> None:
    c = CONTRACT_GPT2_LINEAR
    t = c.templates
    assert t.question_leading_space
    got = prompts.query_prompt(c, _encode, "q2", (), False, (("user", "q1"), ("assistant", " a")))
    assert got == [
        *t.query_prefix, *_encode(" q1"), *t.query_suffix, *_encode(" a"),
        *t.query_prefix, *_encode(" q2"), *t.query_suffix,
    ]  # fmt: skip
