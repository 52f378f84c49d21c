"""The HTTP door under generated bodies: for every JSON route, a body the route answers with
0-3 members changed (set to a value of their declared type or of any JSON type, removed, or
unknown ones added), bodies built from the route's field declarations alone, and any JSON at
all, never get a 5xx. Every refusal is a 4xx whose JSON error names a field and says what is
wrong, with the request's id; every answer is a 200; both kinds occur. Afterwards the server
is healthy and the engine holds no page but cached prefixes'. Examples are derandomized: the
same bodies every run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from image_pipeline import sample_image_bytes
from tests.http_support import data_url, post
from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    engine_of,
    in_process,
    local_config,
    wait_for,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.http.body import Field
from vlm_server.http.routes import ROUTES
from vlm_server.models.interface import LoadedModel

IMG = data_url(sample_image_bytes())
JSON_ROUTES = [r for r in ROUTES if r.method == "POST" and r.request]
SHORT = 4  # tokens of an answer: the CPU model is slow

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
any_json = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
content_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)}),
        st.fixed_dictionaries(
            {
                "type": st.just("image_url"),
                "image_url": st.fixed_dictionaries({"url": st.just(IMG)}),
            }
        ),
        any_json,
    ),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
            "content": st.one_of(st.text(max_size=16), content_parts, any_json),
        }
    ),
    min_size=0,
    max_size=3,
)


def _typed(field: Field) -> st.SearchStrategy[Any]:
    """Values of ``field``'s declared type (picture fields get a real picture, enums their
    words), before any JSON value at all."""
    if field.name == "messages":
        return messages
    if field.name in ("image_url", "url"):
        return st.sampled_from([IMG, "data:image/png;base64,AAAA", "https://example.com/a.jpg"])
    if field.enum:
        return st.sampled_from(field.enum) | st.text(max_size=6)
    if field.name in ("max_tokens", "max_completion_tokens", "max_objects"):
        return st.integers(min_value=-2, max_value=SHORT)
    kinds: dict[str, st.SearchStrategy[Any]] = {
        "string": st.text(max_size=16),
        "number": st.floats(min_value=-2, max_value=3, allow_nan=False),
        "integer": st.integers(min_value=-3, max_value=2**31),
        "boolean": st.booleans(),
    }
    if field.type in kinds:
        return kinds[field.type]
    if field.type == "array":
        item = _value(field.items) if field.items is not None else any_json
        return st.lists(item, max_size=4)
    if field.type == "object" and field.fields:
        return _object(field.fields)
    return any_json


def _value(field: Field) -> st.SearchStrategy[Any]:
    return st.one_of(_typed(field), _typed(field), _typed(field), any_json)


def _object(fields: tuple[Field, ...]) -> st.SearchStrategy[dict[str, Any]]:
    optional = {f.name: _value(f) for f in fields}
    base = st.fixed_dictionaries({}, optional=optional)  # type: ignore[arg-type]
    extra = st.dictionaries(st.text(min_size=1, max_size=6), any_json, max_size=1)
    return st.tuples(base, extra | st.just({}), st.booleans()).map(
        lambda t: {**t[0], **t[1]} if t[2] else t[0]
    )


# A body each route answers, which the examples then change: 0-3 members set to a value of
# their declared type or of any JSON type, removed, or unknown ones added.
VALID: dict[str, dict[str, Any]] = {
    "/v1/caption": {"image_url": IMG, "length": "short", "settings": {"max_tokens": SHORT}},
    "/v1/query": {"image_url": IMG, "question": "what?", "settings": {"max_tokens": SHORT}},
    "/v1/point": {"image_url": IMG, "object": "cat", "settings": {"max_objects": 2}},
    "/v1/detect": {"image_url": IMG, "object": "cat", "settings": {"max_objects": 2}},
    "/v1/segment": {"image_url": IMG, "object": "cat", "settings": {"max_tokens": 8}},
    "/v1/chat/completions": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is it?"},
                    {"type": "image_url", "image_url": {"url": IMG}},
                ],
            }
        ],
        "max_tokens": SHORT,
    },
}


@st.composite
def changed_body(draw: st.DrawFn, valid: dict[str, Any], fields: tuple[Field, ...]) -> Any:
    """``valid`` with 0-3 members (settings' too) set to a value of their declared type or of
    any JSON type, removed, or unknown ones added."""
    body = json.loads(json.dumps(valid))
    by_name = {f.name: f for f in fields}
    inner = {f.name: f for f in by_name["settings"].fields} if "settings" in by_name else {}
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        kind = draw(st.sampled_from(["set", "set", "setting", "drop", "unknown"]))
        if kind == "set":
            name = draw(st.sampled_from(sorted(by_name)))
            body[name] = draw(_value(by_name[name]))
        elif kind == "setting" and inner and isinstance(body.get("settings"), dict):
            name = draw(st.sampled_from(sorted(inner)))
            body["settings"][name] = draw(_value(inner[name]))
        elif kind == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif kind == "unknown":
            body[draw(st.text(max_size=6))] = draw(any_json)
    return body


def _changed(route: Any) -> st.SearchStrategy[Any]:
    return changed_body(VALID[route.path], route.request)


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=8, max_queue=100, kv_budget_bytes=16 << 20)
    factory = in_process(lambda: GatedBatchedEngine(tiny, config))
    with ServerThread(local_config(http_port=-1), factory) as s:
        yield s


@pytest.mark.parametrize("route", JSON_ROUTES, ids=[r.path for r in JSON_ROUTES])
def test_generated_bodies_get_a_4xx_naming_a_field_or_an_answer(
    server: ServerThread, route: Any
) -> None:
    seen: dict[int, int] = {}
    root = server.http_url.removesuffix("/v1")  # the routes' paths hold their /v1

    @settings(
        max_examples=30,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=st.one_of(_changed(route), _changed(route), _object(route.request), any_json))
    def check(body: Any) -> None:
        status, headers, raw = post(root + route.path, body)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (body, raw[:300])
        if status == 200:
            assert raw
            return
        assert 400 <= status < 500
        answer = json.loads(raw)
        error = answer["error"]
        assert error["field"] and error["message"], answer
        assert answer["request_id"] == headers["X-Request-Id"]

    check()
    assert 200 in seen and any(400 <= s < 500 for s in seen), seen  # both kinds were sent


def test_the_server_is_healthy_and_holds_no_page_after_the_fuzz(server: ServerThread) -> None:
    status, _, _ = _get(server.http_url.removesuffix("/v1") + "/health")
    assert status == 200
    engine = engine_of(server)
    assert isinstance(engine, GatedBatchedEngine)
    wait_for(engine.idle, what="an idle engine")
    pages = engine.scheduler.pages
    assert pages.used_pages == engine.cached_prefix_pages()


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()
