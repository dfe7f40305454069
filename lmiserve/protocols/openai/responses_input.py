"""The `input` of a Responses request (POST /v1/responses) as chat messages: a string (one user message)
or a list of items, ``message`` (``type`` may be left out; roles ``user``, ``assistant``, ``system``,
``developer``, given to the template as ``system``; content a string or ``input_text`` / ``output_text``
/ ``refusal`` parts), ``function_call`` (``call_id``, ``name``, ``arguments``), ``function_call_output``
(``call_id``, ``output``), and ``reasoning`` items given back (left out of the prompt, as chat templates
leave earlier reasoning out). Anything else is a 400 naming the item at fault (`responses_request`)."""

from __future__ import annotations

from typing import Any

from lmiserve.core.errors import InvalidRequest, excerpt
from lmiserve.core.media import ImageSource
from lmiserve.protocols.openai.errors import InvalidValue
from lmiserve.protocols.textgen import images
from lmiserve.protocols.textgen.chat import Message

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "refusal")
IMAGE_PART = "input_image"  # {"type": "input_image", "image_url": "data:..." | "https://...", "detail"?: ...}


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as text; other parts are a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidValue(f"`{where}` must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == IMAGE_PART:
            texts.append(images.MARK)  # `image_sources` gives its image, in the same order
            continue
        if kind not in TEXT_PARTS:
            shown = excerpt(str(kind)) if kind is not None else "a part without a type"
            raise InvalidValue(
                f"Content part type `{shown}` is not supported: this server takes "
                f"{', '.join(TEXT_PARTS)} and {IMAGE_PART} parts",
                f"{where}[{j}].type",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise InvalidValue(f"`{where}[{j}]` needs a string `{'refusal' if kind == 'refusal' else 'text'}`", where)
        texts.append(text)
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidValue(f"`{where}.{key}` must be a string", f"{where}.{key}")
    return value


def messages(items: list[dict[str, Any]], instructions: str | None) -> list[Message]:
    """The conversation as chat messages (see the module docstring); a 400 naming the item at fault."""
    out: list[Message] = []
    if instructions:
        out.append(Message(role="system", content=instructions))
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidValue(f"`{where}` must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                allowed = ", ".join(f"'{r}'" for r in ROLES)
                shown = excerpt(str(role))
                raise InvalidValue(f"Invalid value: '{shown}'. Supported values are: {allowed}.", f"{where}.role")
            text = _text_of(item.get("content"), f"{where}.content")
            out.append(Message(role="system" if role == "developer" else role, content=text))
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            if out and out[-1].role == "assistant":  # calls after the assistant's text (or after calls): one turn
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(Message(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            out.append(Message(role="tool", content=text, tool_call_id=_string(item, "call_id", where)))
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            shown = excerpt(str(kind))
            raise InvalidValue(
                f"Input item type `{shown}` is not supported: use message, function_call, function_call_output "
                "or reasoning items",
                f"{where}.type",
            )
    if not out:
        raise InvalidValue("`input` must hold at least one message", "input")
    return out


def image_sources(items: list[Any]) -> list[ImageSource]:
    """The ``input_image`` parts' sources, in the order `messages` writes their marks (a message's
    content, a ``function_call_output``'s output parts); ``file_id`` (an uploaded file) is a 400: this
    server keeps no files. Malformed items are left to `messages`."""
    sources: list[ImageSource] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        key = "content" if kind == "message" else "output" if kind == "function_call_output" else None
        parts = item.get(key) if key is not None else None
        if not isinstance(parts, list):
            continue
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != IMAGE_PART:
                continue
            where = f"input[{i}].{key}[{j}]"
            url = part.get("image_url")
            if url is None and part.get("file_id") is not None:
                raise InvalidValue(
                    "`file_id` images are not supported: this server keeps no files; give `image_url` (a data: "
                    "or http(s) URL)",
                    f"{where}.file_id",
                )
            try:
                sources.append(images.url_source(url, f"{where}.image_url"))
            except InvalidRequest as exc:
                raise InvalidValue(exc.message, f"{where}.image_url") from None
    return sources
