"""The OpenAI-compatible endpoints with the official ``openai`` client, unmodified: chat
completions streamed and not (answered by the query task, equal to the reference generation),
whole conversations (their earlier turns the query's context, in the layout of the model
author's engine), the model list, and errors that name the parameter at fault."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from image_pipeline import PreparedImage, sample_image_bytes
from tests.http_support import data_url, moondream_client, post_json
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings

# A dev dependency: present in CI; skipped where only the GPU suite's packages are.
openai = pytest.importorskip("openai")

MIB = 1 << 20
IMG = data_url(sample_image_bytes())


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=8, max_queue=100, kv_budget_bytes=16 * MIB)
    with ServerThread(
        local_config(http_port=-1), in_process(lambda: BatchedEngine(tiny, config))
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0) as c:
        yield c


def _user(question: str, image: str | None = None) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": question}]
    if image is not None:
        parts.append({"type": "image_url", "image_url": {"url": image}})
    return [{"role": "user", "content": parts}]


def _greedy(max_tokens: int) -> SamplingSettings:
    return SamplingSettings(temperature=0.0, max_tokens=max_tokens)


def test_a_chat_completion_is_the_query_answer(
    client: openai.OpenAI, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    got = client.chat.completions.create(
        model="moondream", messages=_user("what is this?", IMG), temperature=0, max_tokens=7
    )
    want = generator.query(sample_image, "what is this?", _greedy(7))
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == "length" and got.model == "tiny"
    assert got.usage is not None and got.usage.completion_tokens == 7
    assert got.usage.prompt_tokens == want.prompt_tokens
    assert got.usage.total_tokens == got.usage.prompt_tokens + 7
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    # A plain string content, no picture, max_completion_tokens instead of max_tokens.
    text_only = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "tell me a story"}],
        temperature=0,
        max_completion_tokens=9,
    )
    story = generator.query(None, "tell me a story", _greedy(9)).text
    assert text_only.choices[0].message.content == story


def test_a_streamed_chat_completion_ends_with_done(
    client: openai.OpenAI, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    chunks = list(
        client.chat.completions.create(
            model="moondream",
            messages=_user("what is this?", IMG),
            temperature=0,
            # Long enough that a reader falling behind (its queued deltas arrive merged, by
            # design) still sees the answer in more than one piece on a busy machine.
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    want = generator.query(sample_image, "what is this?", _greedy(48)).text
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == want
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in with_choices if c.choices[0].delta.content) > 1  # really streamed
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 48
    assert {c.id for c in chunks} == {chunks[0].id}


def test_the_model_list_names_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_the_model_list_states_the_limits(client: openai.OpenAI) -> None:
    """The served model's context and every limit a client can hit, by GetModelInfo's
    names, with this door's body cap."""
    (model,) = client.models.list()
    extra = model.model_extra or {}
    limits = extra["limits"]
    assert extra["max_model_len"] == limits["max_tokens"] > 0
    for name in ("max_image_bytes", "max_image_pixels", "max_question_chars", "max_queue"):
        assert limits[name] > 0, name
    assert limits["max_http_body_bytes"] > 0


ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("negative temperature", {"temperature": -1}, "temperature"),
    ("top_p zero", {"top_p": 0}, "top_p"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("max_completion_tokens zero", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("two choices", {"n": 2}, "n"),
    ("five stop sequences", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("an empty stop sequence", {"stop": [""]}, "stop"),
    (
        "a system turn after the question",
        {"messages": [*_user("hi"), {"role": "system", "content": "be brief"}]},
        "messages[1].role",
    ),
    ("no question", {"messages": [{"role": "system", "content": "be brief"}]}, "messages[0].role"),
    ("an empty conversation", {"messages": []}, "messages"),
    ("an unknown role", {"messages": [{"role": "narrator", "content": "hi"}]}, "messages[0].role"),
    (
        "a conversation ending with the assistant",
        {"messages": [*_user("hi"), {"role": "assistant", "content": "hello"}]},
        "messages[1].role",
    ),
    (
        "two pictures in two turns",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                *_user("what?", IMG),
                {"role": "assistant", "content": "a cat"},
                *_user("and this?", IMG),
            ]
        },
        "messages[3].content[1]",
    ),
    (
        "a picture in a system turn",
        {
            "messages": [
                {"role": "system", "content": [{"type": "image_url", "image_url": {"url": IMG}}]},
                *_user("hi"),
            ]
        },
        "messages[0].content[0]",
    ),
    ("a tool turn", {"messages": [{"role": "tool", "content": "42"}]}, "messages[0].role"),
    ("a yaml format", {"response_format": {"type": "yaml"}}, "response_format.type"),
    (
        "a schema keyword beyond the subset",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"anyOf": [{"type": "string"}]}},
                    },
                },
            }
        },
        "response_format.json_schema.schema.properties.a.anyOf",
    ),
    (
        "a schema too large for the regex cap",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {f"p{i}": {"type": "number"} for i in range(40)},
                    },
                },
            }
        },
        "response_format",
    ),
    (
        "an assistant turn",
        {"messages": [{"role": "assistant", "content": "hi"}]},
        "messages[0].role",
    ),
    ("an empty question", {"messages": [{"role": "user", "content": " "}]}, "messages[0].content"),
    (
        "a remote picture",
        {"messages": _user("what?", "https://example.com/a.jpg")},
        "messages[0].content[1].image_url.url",
    ),
    (
        "a broken picture",
        {"messages": _user("what?", data_url(b"\x00garbage" * 64))},
        "messages[0].content[1].image_url.url",
    ),
    (
        "two pictures",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": IMG}},
                        {"type": "image_url", "image_url": {"url": IMG}},
                    ],
                }
            ]
        },
        "messages[0].content[1]",
    ),
    (
        "an audio part",
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages[0].content[0].type",
    ),
]


@pytest.mark.parametrize(("case", "kwargs", "param"), ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_parameter(
    client: openai.OpenAI, case: str, kwargs: dict[str, Any], param: str
) -> None:
    request: dict[str, Any] = {"model": "m", "messages": _user("hi"), "max_tokens": 2, **kwargs}
    if "max_completion_tokens" in kwargs:
        del request["max_tokens"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    err = caught.value
    assert err.status_code == 400
    body = err.body
    assert isinstance(body, dict)
    assert body["param"] == body["field"] == param
    assert body["code"] == "INVALID_ARGUMENT" and body["type"] == "invalid_request_error"
    assert body["message"].startswith(f"{param}:")


def test_the_server_still_answers(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(model="m", messages=_user("ok?"), max_tokens=2)
    assert got.choices[0].finish_reason in ("stop", "length")


# ---- system messages, stop sequences, response formats ------------------------------------


def test_system_messages_come_before_the_question(
    client: openai.OpenAI, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    """System (and developer) texts, then the user's, joined by blank lines: the question."""
    got = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "developer", "content": [{"type": "text", "text": "Be kind."}]},
            *_user("what is this?", IMG),
        ],
        temperature=0,
        max_tokens=6,
    )
    question = "Answer briefly.\n\nBe kind.\n\nwhat is this?"
    assert (
        got.choices[0].message.content == generator.query(sample_image, question, _greedy(6)).text
    )


# ---- conversations ------------------------------------------------------------------------

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Answer briefly."},
    *_user("what is this?", IMG),
    {"role": "assistant", "content": "a picture"},
    {"role": "user", "content": "what colours are in it?"},
]
# What the conversation becomes: the system text folded into the first user turn, that turn
# and the reply before the question.
HISTORY = (("user", "Answer briefly.\n\nwhat is this?"), ("assistant", "a picture"))
FOLLOW_UP = "what colours are in it?"


def _conversation_prompt_tokens(generator: ReferenceGenerator) -> int:
    """The prompt's length, counted from the author's layout (not from the server's code):
    a query block per user turn, the answer suffix and text per assistant turn."""
    t = generator.contract.templates
    n = len(t.query_prefix) + len(generator.tokenizer.encode(HISTORY[0][1]).ids)
    n += len(t.query_suffix) + len(generator.tokenizer.encode(HISTORY[1][1]).ids)
    n += len(t.query_prefix) + len(generator.tokenizer.encode(FOLLOW_UP).ids)
    return n + len(t.query_suffix)


def test_a_conversation_is_one_query_with_its_earlier_turns(
    client: openai.OpenAI, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    got = client.chat.completions.create(
        model="m", messages=CONVERSATION, temperature=0, max_tokens=8
    )
    want = generator.query(sample_image, FOLLOW_UP, _greedy(8), history=HISTORY)
    assert got.choices[0].message.content == want.text
    assert got.usage is not None
    assert got.usage.prompt_tokens == want.prompt_tokens == _conversation_prompt_tokens(generator)
    # The earlier turns reach the model: without them the prompt is shorter.
    alone = generator.query(sample_image, FOLLOW_UP, _greedy(8))
    assert alone.prompt_tokens < want.prompt_tokens
    # Streamed: the same answer.
    chunks = client.chat.completions.create(
        model="m", messages=CONVERSATION, temperature=0, max_tokens=8, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text


def test_reasoning_over_a_conversation_opens_only_the_last_turn(
    client: openai.OpenAI, generator: ReferenceGenerator
) -> None:
    got = client.chat.completions.create(
        model="m",
        messages=CONVERSATION,
        temperature=0,
        max_tokens=8,
        extra_body={"reasoning": True},
    )
    t = generator.contract.templates
    assert t.reasoning_suffix is not None and got.usage is not None
    want = _conversation_prompt_tokens(generator) - len(t.query_suffix) + len(t.reasoning_suffix)
    assert got.usage.prompt_tokens == want


def test_a_picture_in_a_later_turn_is_the_conversation_picture(
    client: openai.OpenAI, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        *_user("what is this?", IMG),
    ]
    got = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=6)
    history = (("user", "hello"), ("assistant", "hi"))
    want = generator.query(sample_image, "what is this?", _greedy(6), history=history)
    assert got.choices[0].message.content == want.text


def test_a_conversation_over_raw_http_and_an_echoed_reply(
    server: ServerThread, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    """An assistant message echoed back as a response gave it (its null members and its
    reasoning included) is read as the turn it was; a too long conversation names messages."""
    reply = {"role": "assistant", "content": "a picture", "reasoning_content": "hmm"}
    echoed = [*CONVERSATION[:2], {**reply, "refusal": None, "tool_calls": None}, CONVERSATION[3]]
    status, body = post_json(
        f"{server.http_url}/chat/completions",
        {"model": "m", "messages": echoed, "temperature": 0, "max_tokens": 8},
    )
    want = generator.query(sample_image, FOLLOW_UP, _greedy(8), history=HISTORY)
    assert status == 200 and body["choices"][0]["message"]["content"] == want.text, body
    long = [{"role": "user", "content": "x" * 9000}, {"role": "assistant", "content": "y"}]
    status, body = post_json(
        f"{server.http_url}/chat/completions",
        {"messages": [*long, {"role": "user", "content": "z" * 9000}], "max_tokens": 2},
    )
    assert status == 400 and body["error"]["field"] == "messages", body


def test_the_moondream_client_chats_a_conversation(
    server: ServerThread,
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The official moondream client's chat (model "moondream3-preview" unless told, its
    max_tokens sent as max_completion_tokens), unary and streamed."""
    cache = getattr(pytestconfig, "cache", None)
    where = cache.mkdir("clients") if cache is not None else tmp_path_factory.mktemp("clients")
    model = moondream_client(where).vl(endpoint=server.http_url)
    settings = {"temperature": 0, "max_tokens": 8}
    want = generator.query(sample_image, FOLLOW_UP, _greedy(8), history=HISTORY).text
    got = model.chat(CONVERSATION, settings=settings)
    assert got["message"]["content"] == want and got["finish_reason"] == "length"
    streamed = model.chat(CONVERSATION, stream=True, settings=settings)
    assert "".join(streamed["message"]) == want


def _stop_inside(text: str) -> str:
    """A stop sequence that first occurs somewhere in the middle of ``text``."""
    for start in range(6, len(text) - 3):
        stop = text[start : start + 3]
        if stop.strip() and text.find(stop) == start:
            return stop
    raise AssertionError(f"no stop sequence to cut {text!r} with")


def test_a_stop_sequence_ends_the_answer_and_is_never_sent(
    client: openai.OpenAI, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    full = generator.query(sample_image, "what is this?", _greedy(40)).text
    stop = _stop_inside(full)
    want = full[: full.find(stop)]
    request: dict[str, Any] = {
        "model": "m",
        "messages": _user("what is this?", IMG),
        "temperature": 0,
        "max_tokens": 40,
        "stop": [stop, "\x00never"],
    }
    got = client.chat.completions.create(**request)
    assert got.choices[0].message.content == want
    assert got.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == want and not any(stop in d for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_json_schema_answer_is_json_that_follows_it(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "count": {"type": "integer"},
            "ok": {"type": "boolean"},
            "kind": {"enum": ["cat", "dog"]},
        },
        "required": ["name", "count", "ok", "kind"],
    }
    for seed in range(3):
        got = client.chat.completions.create(
            model="m",
            messages=_user("describe it as JSON"),
            temperature=1,
            seed=seed,
            max_tokens=200,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "thing", "schema": schema, "strict": True},
            },
        )
        answer = json.loads(got.choices[0].message.content or "")
        assert list(answer) == ["name", "count", "ok", "kind"]
        assert isinstance(answer["name"], str) and len(answer["name"]) <= 6
        assert isinstance(answer["count"], int) and isinstance(answer["ok"], bool)
        assert answer["kind"] in ("cat", "dog")


def test_a_json_object_answer_only_ever_extends_an_object(client: openai.OpenAI) -> None:
    """Unbounded strings may run out of tokens; what was written is always on the way to a
    JSON object (its first byte is ``{``), and a finished answer is one."""
    got = client.chat.completions.create(
        model="m",
        messages=_user("json please"),
        temperature=1,
        seed=1,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    text = got.choices[0].message.content or ""
    assert text.startswith("{")
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
