"""A chat conversation with tools rendered through the model's chat template.

- Tool definitions go to the template as transformers' ``tools`` when the template shows them (found
  by rendering a probe tool and looking for its name); otherwise they are listed in a system prompt.
- With lmiserve's JSON format (`ToolSpec.native` false: the template has no call format of its own) the
  system prompt also gets a short instruction on that format (or TGI's `tool_prompt`). A model with its
  own format (a `tool_call_parser` other than ``json``) gets no instruction: its template teaches it
  (TGI's `tool_prompt` is still added when given).
- ``tool_choice: "none"`` hides nothing: a template that shows tools still gets them (as OpenAI and vLLM
  do), and nothing is instructed or parsed. With lmiserve's JSON format the model then sees no tools.
- Assistant messages with ``tool_calls`` and ``role: "tool"`` results go to the template as they are
  (arguments as objects, the result with its ``tool_call_id`` and function ``name``) when a probe
  conversation shows the template renders them; otherwise a call becomes the assistant's text in the
  answer format (``{"name": ..., "parameters": ...}``) and results become user messages.
- A template that still fails gets, in turn, the fallback rendering of everything, then the
  instruction at the start of the first user message instead of a system message (for templates that
  reject the system role).

A conversation without tools and tool messages is rendered exactly as before.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from lmiserve.core.errors import TemplateError
from lmiserve.protocols.textgen.chat import Message
from lmiserve.protocols.textgen.errors import ToolError
from lmiserve.protocols.textgen.tools.functions import NO_PARAMETERS, Function
from lmiserve.protocols.textgen.tools.spec import ToolSpec

Render = Callable[..., str]  # (messages, tools=...) -> prompt text; raises TemplateError

_PROBE_TOOL = Function("lmiserve_probe_tool", None, NO_PARAMETERS)
_PROBE_CALL = "lmiserve_probe_call"
_PROBE_RESULT = "lmiserve_probe_result"


def instruction(spec: ToolSpec, *, list_tools: bool) -> str:
    """The system prompt text: the tools (when the template does not show them) and the answer format."""
    parts = []
    if list_tools:
        listing = "\n".join(json.dumps(f.definition()["function"], ensure_ascii=False) for f in spec.functions)
        parts.append(f"You can call the following functions:\n{listing}")
    if spec.prompt is not None:
        parts.append(spec.prompt)
    elif spec.native:
        pass  # the template teaches the model its own format
    elif spec.mode == "named":
        name = spec.functions[0].name
        parts.append(f'Call the function {name}: reply with {{"name": "{name}", "parameters": <its arguments>}}.')
    else:
        text = 'To call a function, reply with {"name": <function name>, "parameters": <its arguments>}'
        text += ", or with a JSON array of such objects to call several." if spec.parallel else "."
        if spec.mode == "auto":
            text += " To answer without calling a function, reply in plain text."
        parts.append(text)
    return "\n\n".join(parts)


def render_conversation(messages: Sequence[Message], spec: ToolSpec, render: Render) -> str:
    """The prompt of a chat request (see the module docstring)."""
    has_tool_messages = any(m.tool_calls or m.role == "tool" for m in messages)
    shown = bool(spec.functions) and spec.native and spec.mode == "none"  # "none" hides nothing
    if not spec.active and not has_tool_messages and not shown:
        return render([{"role": m.role, "content": m.text()} for m in messages])
    native_calls, native_results = _renders_tool_messages(render) if has_tool_messages else (False, False)
    native_tools = (spec.active or shown) and _shows_tools(render)
    attempts = [(native_calls, native_results, native_tools, "system"), (False, False, False, "system")]
    if spec.active:
        attempts.append((False, False, False, "user"))
    error: TemplateError | None = None
    for calls, results, tools, place in dict.fromkeys(attempts):
        conversation = _conversation(messages, native_calls=calls, native_results=results)
        text = instruction(spec, list_tools=not tools) if spec.active else ""
        if text:
            _instruct(conversation, text, place)
        try:
            if tools:
                return render(conversation, tools=[f.definition() for f in spec.functions])
            return render(conversation)
        except TemplateError as exc:
            error = exc
    assert error is not None
    raise error


def _instruct(conversation: list[dict[str, Any]], text: str, place: str) -> None:
    if place == "system":
        if conversation and conversation[0]["role"] == "system":
            first = conversation[0]
            first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        else:
            conversation.insert(0, {"role": "system", "content": text})
        return
    for message in conversation:
        if message["role"] == "user":
            message["content"] = f"{text}\n\n{message['content']}"
            return
    conversation.insert(0, {"role": "user", "content": text})


# --- tool messages ----------------------------------------------------------------------------------


def _calls_of(message: Message, index: int) -> list[tuple[str, str, Any]]:
    """(id, name, arguments) of an assistant message's `tool_calls`; arguments as an object when they
    are a JSON object text."""
    calls = []
    for i, call in enumerate(message.tool_calls or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f"`messages[{index}].tool_calls[{i}]` must have a `function` with a `name`")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # else kept as the text the client sent
                arguments = json.loads(arguments) if arguments.strip() else {}
        calls.append((str(call.get("id", "")), function["name"], arguments))
    return calls


def _answer_text(calls: list[tuple[str, str, Any]]) -> str:
    """Calls in the answer format the model is asked to use."""
    objects = [{"name": name, "parameters": arguments} for _, name, arguments in calls]
    return json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=False)


def _conversation(messages: Sequence[Message], *, native_calls: bool, native_results: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    result_run = False  # the last message is a converted tool result
    for index, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls = _calls_of(m, index)
            names.update((call_id, name) for call_id, name, _ in calls)
            if native_calls:
                tool_calls = [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                    for call_id, name, arguments in calls
                ]
                out.append({"role": "assistant", "content": m.text(), "tool_calls": tool_calls})
            else:
                text, answer = m.text(), _answer_text(calls)
                out.append({"role": "assistant", "content": f"{text}\n{answer}" if text else answer})
            result_run = False
        elif m.role == "tool":
            name = names.get(m.tool_call_id or "", m.name or "")
            if native_results:
                result: dict[str, Any] = {"role": "tool", "content": m.text(), "tool_call_id": m.tool_call_id or ""}
                if name:
                    result["name"] = name
                out.append(result)
                result_run = False
                continue
            line = f"Result of {name or 'the function call'}: {m.text()}"
            if result_run:
                out[-1]["content"] += f"\n{line}"
            else:
                out.append({"role": "user", "content": line})
            result_run = True
        else:
            out.append({"role": m.role, "content": m.text()})
            result_run = False
    return out


# --- what the template can show ---------------------------------------------------------------------


def _shows_tools(render: Render) -> bool:
    try:
        text = render([{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL.definition()])
    except TemplateError:
        return False
    return _PROBE_TOOL.name in text


def _renders_tool_messages(render: Render) -> tuple[bool, bool]:
    """(assistant tool_calls rendered, tool results rendered) by the template as they are."""
    probe = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "0", "type": "function", "function": {"name": _PROBE_CALL, "arguments": {}}}],
        },
        {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": "0"},
    ]
    try:
        text = render(probe)
    except TemplateError:
        return False, False
    return _PROBE_CALL in text, _PROBE_RESULT in text
