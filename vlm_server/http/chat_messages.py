"""A chat's ``messages`` as one query: the earlier turns, the question and the picture.

Moondream has no multi-turn format of its own; its author's engine renders a conversation as
a run of query blocks, and so do we (`models.prompts.query_prompt`'s ``history``):

* ``system`` (or ``developer``) messages come first; their texts, joined by blank lines, are
  folded into the first user turn as ``"<system>\\n\\n<user text>"`` (the system text alone
  when that turn has none);
* each earlier ``user`` turn is a query's prefix and its text, each ``assistant`` turn the
  answer suffix and its text, in the order sent (an assistant's reasoning is not replayed);
* the conversation ends with a ``user`` turn: the question, then the answer (or reasoning)
  suffix the model completes;
* a message's text parts are concatenated as sent; its text is a string or text parts.

At most one picture in the whole conversation, in a user turn. The model reads it where it
always does, right after the start token, whichever user turn carries it; the author's
engine puts a turn's pictures at the start of that turn, so the two agree when the picture
comes with the first user message. At most `MAX_MESSAGES` messages. Errors name the JSON path
at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_server.frontend.refusals import invalid
from vlm_server.http.body import Field, check
from vlm_server.models.prompts import ASSISTANT, USER

# Each turn costs prompt positions even when empty; far more turns than any context holds are
# refused before anything is built for them.
MAX_MESSAGES = 512
SYSTEM_ROLES = ("system", "developer")
ROLES = (*SYSTEM_ROLES, USER, ASSISTANT)

_PART_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["text", "image_url"]},
        "text": {"type": "string"},
        "image_url": {
            "type": "object",
            "properties": {"url": {"type": "string"}, "detail": {"type": "string"}},
        },
    },
}
MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": list(ROLES)},
        "content": {
            "description": "Text, or content parts: text and (in a user turn) image_url, a "
            "base64 data URL; one picture per conversation. Null only for an assistant turn.",
            "oneOf": [{"type": "string"}, {"type": "array", "items": _PART_SCHEMA}],
        },
        "name": {"type": "string"},
    },
}

_PART = (
    Field("type", "string", "", required=True, enum=("text", "image_url")),
    Field("text", "string", ""),
    Field(
        "image_url",
        "object",
        "",
        fields=(Field("url", "string", "", required=True), Field("detail", "string", "")),
    ),
)


def _absent(name: str, what: str, ok: tuple[Any, ...] = (None,)) -> Field:
    return Field(name, "any", "", unsupported=f"{what} is not supported", unsupported_ok=ok)


_MESSAGE = (
    Field("role", "string", "", required=True),
    Field("content", "any", ""),
    Field("name", "string", ""),
    # What an assistant message echoed back from a response may carry: its reasoning (not
    # replayed, as in the author's engine) and the empty members of OpenAI's message.
    Field("reasoning_content", "any", ""),
    Field("reasoning", "any", ""),
    Field("reasoning_details", "any", ""),
    _absent("refusal", "a refusal"),
    _absent("tool_calls", "tool calling", (None, [])),
    _absent("function_call", "function calling"),
    _absent("audio", "audio"),
    _absent("annotations", "annotations", (None, [])),
)


@dataclass(frozen=True)
class Picture:
    url: str
    field: str  # its JSON path, for errors about it


@dataclass(frozen=True)
class Conversation:
    history: tuple[tuple[str, str], ...]  # the earlier turns: (USER or ASSISTANT, text)
    question: str  # the last user turn's text (the system text folded in if it is the first)
    question_field: str  # its JSON path
    picture: Picture | None
    chars: int  # characters of all the turns' texts


def read(messages: list[Any]) -> Conversation:
    """The conversation of a chat's ``messages`` (see the module's docstring)."""
    if not messages:
        raise invalid("messages", "must hold at least one message: the question, last")
    if len(messages) > MAX_MESSAGES:
        raise invalid("messages", f"holds {len(messages)} messages; at most {MAX_MESSAGES}")
    system: list[str] = []
    turns: list[tuple[str, str, str]] = []  # (role, text, JSON path of its content)
    picture: Picture | None = None
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        msg = check(_MESSAGE, raw, where)
        role = msg["role"]
        if role not in ROLES:
            raise invalid(
                f"{where}.role",
                f"must be system, developer, user or assistant, got {str(role)[:20]!r}"
                + (": tool calling is not supported" if role in ("tool", "function") else ""),
            )
        content = msg.get("content")
        if content is None and role != ASSISTANT:
            raise invalid(f"{where}.content", "is required")
        text, found = _content(content, f"{where}.content", role == USER)
        if found is not None:
            if picture is not None:
                raise invalid(
                    found.field.removesuffix(".image_url.url"),
                    f"this model takes one picture per conversation; {picture.field} is one",
                )
            picture = found
        if role in SYSTEM_ROLES:
            if turns:
                raise invalid(f"{where}.role", "system messages come first, before any turn")
            system.append(text)
        else:
            turns.append((role, text, f"{where}.content"))
    last = len(messages) - 1
    if not turns or turns[-1][0] != USER:
        raise invalid(f"messages[{last}].role", "the conversation must end with a user turn")
    if system:
        first = next(i for i, turn in enumerate(turns) if turn[0] == USER)
        role, text, field = turns[first]
        folded = "\n\n".join(system)
        turns[first] = (role, f"{folded}\n\n{text}" if text else folded, field)
    *earlier, (_, question, field) = turns
    return Conversation(
        history=tuple((role, text) for role, text, _ in earlier),
        question=question,
        question_field=field,
        picture=picture,
        chars=sum(len(text) for _, text, _ in turns),
    )


def _content(content: Any, where: str, pictures: bool) -> tuple[str, Picture | None]:
    """A message's text (parts concatenated) and its picture, if it may hold one."""
    if content is None:
        return "", None
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise invalid(where, "must be a string or an array of content parts")
    texts: list[str] = []
    picture: Picture | None = None
    for i, raw in enumerate(content):
        at = f"{where}[{i}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in ("text", "image_url"):  # the part's kind first: it decides the rest
            raise invalid(f"{at}.type", f"must be text or image_url, got {str(kind)[:40]!r}")
        part = check(_PART, raw, at)
        if kind == "text":
            if part.get("text") is None:
                raise invalid(f"{at}.text", "is required in a text part")
            texts.append(part["text"])
            continue
        if not pictures:
            raise invalid(at, "only a user message may hold a picture; this one holds text only")
        if part.get("image_url") is None:
            raise invalid(f"{at}.image_url", "is required in an image_url part")
        if picture is not None:
            raise invalid(
                at, f"this model takes one picture per conversation; {picture.field} is one"
            )
        picture = Picture(part["image_url"]["url"], f"{at}.image_url.url")
    return "".join(texts), picture
