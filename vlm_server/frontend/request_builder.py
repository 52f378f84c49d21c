"""Proto request messages -> engine requests: the one place every front door's input is checked.

The gRPC servicer passes the messages it receives; the HTTP door translates its JSON into the
same messages first, so both doors share every check, limit and error message. Errors name the
proto field (``settings.temperature``, ``image_bytes``); a door may rename them for its clients.
"""

from __future__ import annotations

from typing import Any

from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.frontend import validation
from vlm_server.frontend.images import ImageResolver


def _task_fields(
    task: Task, message: Any, max_object_chars: int, max_question_chars: int, max_refs: int
) -> dict[str, Any]:
    if task is Task.CAPTION:
        return {"caption_length": validation.caption_length(message.length)}
    refs = validation.spatial_refs(list(message.spatial_refs), max_refs)
    if task is Task.QUERY:
        return {
            "question": validation.question(message.question, max_question_chars),
            "choices": validation.choices(list(message.choices)),
            "regex": message.regex if message.HasField("regex") else None,
            "reasoning": message.reasoning,
            "spatial_refs": refs,
        }
    return {
        "object_name": validation.object_name(message.object, max_object_chars),
        "spatial_refs": refs,
    }


async def build(
    task: Task,
    message: Any,
    images: ImageResolver,
    *,
    request_id: str,
    deadline: float | None,
    max_tokens_limit: int,
    max_object_chars: int = validation.MAX_OBJECT_CHARS,
    max_question_chars: int = validation.MAX_QUESTION_CHARS,
    max_spatial_refs: int = 0,
) -> GenerationRequest:
    """Check ``message`` (the task's proto request) and build the engine request.

    Cheap checks first (task fields, then settings); decoding the image, the expensive one,
    comes last. Whether the task needs an image is the request compiler's check (it defines
    the tasks): a request without one is refused there, naming ``image``."""
    fields = _task_fields(task, message, max_object_chars, max_question_chars, max_spatial_refs)
    s = validation.settings(message.settings, max_tokens_limit)
    image = await images.resolve(message)
    return GenerationRequest(
        task=task,
        image=image,
        request_id=request_id,
        temperature=s.temperature,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        max_objects=s.max_objects,
        seed=s.seed,
        adapter=s.adapter,
        priority=s.priority,
        clip=validation.clip(task, message.settings),
        deadline=deadline,
        **fields,
    )
