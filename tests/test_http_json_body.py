"""JSON bodies parsed within bounds: any value within the depth and value limits parses as
``json.loads`` would; anything deeper, larger or not JSON is a 400 naming the body, never
another error; large bodies (big plain strings cut out of the parse) give the same values."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlm_server.engine.api import EngineError, ErrorCode
from vlm_server.http.json_body import OFF_LOOP_BYTES, JsonLimits, parse

LIMITS = JsonLimits(max_depth=6, max_values=60, max_skeleton_bytes=1 << 20)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=4), inner, max_size=5)
    ),
    max_leaves=40,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


def _structure(value: Any) -> int:
    """``[ { , :`` outside strings, as the parser counts them."""
    if isinstance(value, list):
        return 1 + max(len(value) - 1, 0) + sum(_structure(v) for v in value)
    if isinstance(value, dict):
        n = len(value)
        return 1 + n + max(n - 1, 0) + sum(_structure(v) for v in value.values())
    return 0


def _refused(data: bytes, limits: JsonLimits = LIMITS) -> EngineError:
    with pytest.raises(EngineError) as caught:
        parse(data, limits)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT and caught.value.field == "body"
    assert caught.value.message.startswith("body: ")
    return caught.value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=values, indent=st.sampled_from([None, 1]), ascii_only=st.booleans())
def test_values_within_the_limits_parse_as_json_loads_and_the_rest_is_refused(
    value: Any, indent: int | None, ascii_only: bool
) -> None:
    data = json.dumps(value, indent=indent, ensure_ascii=ascii_only).encode()
    if _depth(value) > LIMITS.max_depth or _structure(value) + 1 > LIMITS.max_values:
        _refused(data)
    else:
        assert parse(data, LIMITS) == json.loads(data)


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=200) | st.text(alphabet='[]{}",:\\0tfn.e-1 ', max_size=200).map(str.encode)
)
def test_any_bytes_parse_or_are_a_400_naming_the_body(data: bytes) -> None:
    try:
        parse(data, LIMITS)
    except EngineError as err:
        assert err.code is ErrorCode.INVALID_ARGUMENT and err.field == "body"


@pytest.mark.parametrize("depth", [33, 950, 1000, 100_000])
def test_deep_nesting_is_refused_before_the_parser_recurses(depth: int) -> None:
    for body in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
        assert "levels" in _refused(body, JsonLimits()).message
    assert parse(b"[" * 32 + b"]" * 32, JsonLimits()) is not None


def test_brackets_inside_strings_are_text_not_nesting() -> None:
    text = '[[[{{{\\"[[[' * 50
    body = json.dumps({"q": text, "r": "\\\\", "s": '"[[['}).encode()
    assert parse(body, LIMITS) == json.loads(body)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[" + b"0," * 200_000 + b"0]", "values"),
        (b"1" * 5000, "not usable JSON"),
        (b'{"t": NaN}', "not valid JSON"),
        (b'{"a": "\xff"}', "UTF-8"),
    ],
)
def test_too_many_values_and_unusable_numbers_are_refused(body: bytes, says: str) -> None:
    assert says in _refused(body, JsonLimits()).message


def test_large_bodies_parse_to_the_same_values() -> None:
    picture = "data:image/jpeg;base64," + "QUJD" * (OFF_LOOP_BYTES // 2)
    body = {
        "question": 'line\nbreak "quoted" [not nested] \\ é',
        "image_url": picture,
        "settings": {"max_tokens": 5, "temperature": 0.5},
        "choices": ["a", "b" * 70_000, "x\\y" * 30_000],
        picture[:70_000]: "a big key",
        "forged": "\u0000" + "0" * 16 + ":0",
    }
    data = json.dumps(body).encode()
    assert len(data) >= OFF_LOOP_BYTES
    assert parse(data) == json.loads(data)


def test_a_large_body_of_small_values_is_refused_by_its_skeleton() -> None:
    data = json.dumps({"q": ["é" * 10] * 300_000}, ensure_ascii=False).encode()
    assert "besides" in _refused(data, JsonLimits()).message


def test_a_number_beyond_a_double_says_so() -> None:
    """1e999 parses to infinity: the error says what is wrong with it, not "must be a JSON
    number, got number"."""
    from vlm_server.http.body import Field, check

    value = parse(b'{"temperature": 1e999}')
    with pytest.raises(EngineError) as caught:
        check((Field("temperature", "number", ""),), value)
    assert caught.value.field == "temperature"
    assert caught.value.message == (
        "temperature: must be a finite number, got one beyond the range of a double"
    )
