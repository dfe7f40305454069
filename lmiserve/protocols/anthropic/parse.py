"""Anthropic Messages requests -> the prompt (the model's chat template) and a validated engine call.

- ``system`` (a string or text blocks) is the first message; each message's text blocks are joined with
  a blank line between them. An assistant's ``tool_use`` blocks are its tool calls and a user's
  ``tool_result`` blocks the results (``is_error``: the text is prefixed with ``Error: ``), as the chat
  layer renders OpenAI's (`lmiserve.protocols.textgen.tools.prompt`); earlier ``thinking`` blocks are
  left out, as chat templates leave out earlier reasoning. A user's ``image`` blocks (``base64`` or
  ``url`` sources) are its images, for a vision model (`image_sources`; a 400 naming the model
  otherwise); ``document`` blocks, and images anywhere else, are a 400.
- A last message from the assistant (text only) is continued, not answered: the answer goes on from its
  text (Anthropic's prefill); like Anthropic, its text may not end with whitespace.
- ``tools`` are generated as the chat layer generates OpenAI's (the arguments under ``input_schema``);
  ``tool_choice`` ``auto``, ``any`` (a call of any tool), ``tool`` (that tool), ``none`` (no tool: plain
  text); ``disable_parallel_tool_use`` allows one call only.
- ``temperature`` 0 is greedy; unset samples at 1.0 (Anthropic's default). ``top_p`` 1.0 and ``top_k`` 0
  are off.
- ``thinking``: ``enabled`` and ``adaptive`` need a reasoning parser (`reasoning_parser`), whose block is
  answered as a ``thinking`` block; ``budget_tokens`` must be below ``max_tokens`` (as Anthropic checks)
  and bounds the thinking (`thinking_budget`: the engine closes the block after that many tokens, then
  the model answers; ``disabled`` is a budget of 0). The setting reaches the chat template as
  ``enable_thinking`` (false for ``disabled``).

Every problem is an `InvalidRequest` (400) whose message starts with the field it is about.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmiserve.core.errors import ContextLengthExceeded, InvalidRequest, excerpt
from lmiserve.core.limits import TextGenLimits
from lmiserve.core.media import Image, ImageSource
from lmiserve.protocols.anthropic.schema import (
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from lmiserve.protocols.textgen import images
from lmiserve.protocols.textgen.chat import Message
from lmiserve.protocols.textgen.parameters import TextGenParameters
from lmiserve.protocols.textgen.reasoning import Reasoning, Thinking
from lmiserve.protocols.textgen.tools.parsers import ToolParser
from lmiserve.protocols.textgen.tools.prompt import Render, render_conversation
from lmiserve.protocols.textgen.tools.spec import ToolSpec, tool_fields, tool_spec
from lmiserve.protocols.textgen.validation import TextGenCall, check

BLOCK_JOIN = "\n\n"  # between the text blocks of one message


@dataclass
class Prompt:
    text: str
    tools: ToolSpec


@dataclass
class AnthropicCall:
    call: TextGenCall
    prompt: str
    model: str  # echoed in the answer, as Anthropic does
    stream: bool
    tools: ToolSpec | None  # the answer is read as tool calls (active tools only)
    reasoning: Reasoning | None = None  # the answer's thinking is read (a reasoning parser)


def _text_of(blocks: list[Any], where: str) -> str:
    """Text blocks' text joined; any other block (an image in a tool result) is refused."""
    parts = []
    for j, block in enumerate(blocks):
        _refuse_media(block, f"{where}.{j}")
        parts.append(block.text)
    return BLOCK_JOIN.join(parts)


def _refuse_media(block: Any, where: str) -> None:
    if isinstance(block, ImageBlock):
        raise InvalidRequest(f"{where}: `image` blocks are taken in `user` messages only (not here)")
    if isinstance(block, DocumentBlock):
        raise InvalidRequest(
            f"{where}: `document` blocks are not supported: the served model takes text and images only. Send "
            "the content as text blocks."
        )


def _joined(pieces: list[str]) -> str:
    """A user message's blocks as one text: text blocks with a blank line between them, an image's mark
    next to its neighbours (the chat template places the image)."""
    out = ""
    for i, piece in enumerate(pieces):
        if i and piece != images.MARK and pieces[i - 1] != images.MARK:
            out += BLOCK_JOIN
        out += piece
    return out


def image_sources(req: CountTokensRequest) -> list[ImageSource]:
    """The ``image`` blocks' sources, in the order `conversation` writes their marks: ``{"type":
    "base64", "media_type", "data"}`` or ``{"type": "url", "url"}`` (a ``file`` source is a 400: this
    server keeps no files)."""
    sources: list[ImageSource] = []
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str) or message.role != "user":
            continue
        for j, block in enumerate(message.content):
            if isinstance(block, ImageBlock):
                sources.append(_source(block.source, f"messages.{i}.content.{j}.source"))
    return sources


def _source(source: dict[str, Any], where: str) -> ImageSource:
    kind = source.get("type")
    if kind == "base64":
        return images.base64_source(source.get("data"), source.get("media_type"), where)
    if kind == "url":
        return images.url_source(source.get("url"), f"{where}.url")
    if kind == "file":
        raise InvalidRequest(f"{where}: `file` image sources are not supported (this server keeps no files)")
    raise InvalidRequest(f"{where}.type: must be `base64` or `url`. Given: {excerpt(str(kind))}")


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return _text_of(system, "system") or None


def conversation(req: CountTokensRequest) -> tuple[list[Message], bool]:
    """The messages as the chat layer takes them (OpenAI's roles: user, assistant with ``tool_calls``,
    tool), and whether the last one is an assistant's text to continue."""
    out: list[Message] = []
    system = system_text(req.system)
    if system is not None:
        out.append(Message(role="system", content=system))
    prefill = False
    for i, message in enumerate(req.messages):
        where = f"messages.{i}.content"
        last = i == len(req.messages) - 1
        if isinstance(message.content, str):
            out.append(Message(role=message.role, content=message.content))
            prefill = last and message.role == "assistant"
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            at = f"{where}.{j}"
            if isinstance(block, ImageBlock) and message.role == "user":
                texts.append(images.MARK)  # `image_sources` gives its image, in the same order
                continue
            _refuse_media(block, at)
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock | ThinkingBlock | RedactedThinkingBlock):
                if message.role != "assistant":
                    raise InvalidRequest(f"{at}: `{block.type}` blocks can only be in `assistant` messages")
                if isinstance(block, ToolUseBlock):
                    function = {"name": block.name, "arguments": block.input}
                    calls.append({"id": block.id, "type": "function", "function": function})
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise InvalidRequest(f"{at}: `tool_result` blocks can only be in `user` messages")
                if texts:  # text before a result stays before it
                    out.append(Message(role="user", content=_joined(texts)))
                    texts = []
                result = block.content if isinstance(block.content, str) else _text_of(block.content, f"{at}.content")
                result = f"Error: {result}" if block.is_error else result
                out.append(Message(role="tool", content=result, tool_call_id=block.tool_use_id))
        if message.role == "assistant":
            if calls and last:
                raise InvalidRequest(
                    f"{where}: the last message holds `tool_use` blocks: send their `tool_result` blocks in a "
                    "`user` message after it"
                )
            if texts or calls:
                out.append(Message(role="assistant", content=BLOCK_JOIN.join(texts), tool_calls=calls or None))
                prefill = last and not calls
        elif texts:
            out.append(Message(role="user", content=_joined(texts)))
    if prefill and out[-1].text() != out[-1].text().rstrip():
        raise InvalidRequest("messages: final assistant content cannot end with trailing whitespace")
    return out, prefill


def tools_of(req: CountTokensRequest, parser: ToolParser | None = None) -> ToolSpec:
    """`tools` and `tool_choice` as the chat layer's `ToolSpec` (`ToolError` for what it cannot use)."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.input_schema.get("type") != "object":
                raise InvalidRequest(f'tools.{i}.input_schema: must be a JSON Schema of an object ("type": "object")')
            function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
            tools.append({"type": "function", "function": function})
    choice = req.tool_choice
    if choice is None:
        return tool_spec(tools, None, None, parser=parser)
    if isinstance(choice, ToolChoiceNone):
        return tool_spec(tools, "none", None, parser=parser)
    if not tools:
        raise InvalidRequest(f"tool_choice: `{choice.type}` needs `tools`")
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceAuto):
        return tool_spec(tools, "auto", parallel, parser=parser)
    if isinstance(choice, ToolChoiceAny):
        return tool_spec(tools, "required", parallel, parser=parser)
    assert isinstance(choice, ToolChoiceTool)
    return tool_spec(tools, {"type": "function", "function": {"name": choice.name}}, parallel, parser=parser)


def prompt(req: CountTokensRequest, render: Render, *, thinks: bool, parser: ToolParser | None = None) -> Prompt:
    """The rendered prompt; `thinks`: a reasoning parser is configured (``thinking: enabled`` needs one)."""
    if req.thinking is not None and req.thinking.type != "disabled" and not thinks:
        raise InvalidRequest(
            "thinking: this server has no reasoning parser (the `reasoning_parser` setting), so it cannot "
            "tell the model's thinking from its answer"
        )
    messages, prefill = conversation(req)
    tools = tools_of(req, parser)
    flags: dict[str, Any] = {}
    if prefill:
        flags["add_generation_prompt"] = False
        flags["continue_final_message"] = True
    if req.thinking is not None:
        flags["template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    return Prompt(render_conversation(messages, tools, functools.partial(render, **flags) if flags else render), tools)


def _sampling(req: MessagesRequest) -> dict[str, Any]:
    if req.temperature == 0.0:
        sampling: dict[str, Any] = {"do_sample": False, "temperature": None}
    else:
        sampling = {"do_sample": True, "temperature": req.temperature}
    return {
        **sampling,
        "top_p": None if req.top_p == 1.0 else req.top_p,
        "top_k": req.top_k or None,
    }


def _stops(req: MessagesRequest, limits: TextGenLimits) -> list[str]:
    stops = req.stop_sequences or []
    if len(stops) > limits.max_stop_sequences:
        raise InvalidRequest(f"stop_sequences: at most {limits.max_stop_sequences} stop sequences. Given: {len(stops)}")
    if any(not stop.strip() for stop in stops):
        raise InvalidRequest("stop_sequences: each stop sequence must contain non-whitespace")
    return stops


def _too_long(exc: ContextLengthExceeded) -> InvalidRequest:
    if exc.input_tokens > exc.max_input:
        return InvalidRequest(f"prompt is too long: {exc.input_tokens} tokens > {exc.max_input} maximum")
    room = exc.max_total - exc.input_tokens
    return InvalidRequest(
        f"max_tokens: {exc.max_new_tokens} > {room}, which is the maximum allowed number of output tokens for "
        f"this prompt ({exc.input_tokens} prompt tokens, {exc.max_total} tokens in all)"
    )


def messages(
    req: MessagesRequest,
    limits: TextGenLimits,
    count_tokens: Callable[[str], int],
    render: Render,
    *,
    thinking: Thinking[Reasoning] | None = None,
    parser: ToolParser | None = None,
    adapter: str | None = None,
    images: tuple[Image, ...] = (),
) -> AnthropicCall:
    """`thinking`: the model's reasoning parser (None: none); `parser`: the model's tool-call format (None:
    lmiserve's JSON one); `adapter`: the LoRA adapter that answers (None: the base model); `images`: the
    image blocks' images, loaded (`count_tokens` counts their tokens)."""
    if isinstance(req.thinking, ThinkingEnabled) and req.thinking.budget_tokens >= req.max_tokens:
        raise InvalidRequest("`max_tokens` must be greater than `thinking.budget_tokens`")
    stops = _stops(req, limits)
    rendered = prompt(req, render, thinks=thinking is not None, parser=parser)
    params = TextGenParameters(**_sampling(req), max_new_tokens=req.max_tokens, stop=stops, details=True)
    try:
        checked = check(rendered.text, params, limits, count_tokens, stream=req.stream)
    except ContextLengthExceeded as exc:
        raise _too_long(exc) from None
    fields: dict[str, Any] = {"include_stop_str_in_output": False}  # Anthropic names it in `stop_sequence`
    if rendered.tools.read:
        fields.update(tool_fields(rendered.tools, checked.params.grammar))
    reasoning = None
    if thinking is not None:  # a tool grammar applies after the reasoning block, a budget bounds it
        reasoning = thinking.reasoning(rendered.text)
        grammar = fields.get("grammar", checked.params.grammar)
        fields.update(thinking.sampling(reasoning, grammar, thinking_budget(req)))
    return AnthropicCall(
        call=checked.call(adapter=adapter, images=images, **fields),
        prompt=rendered.text,
        model=req.model,
        stream=req.stream,
        tools=rendered.tools if rendered.tools.read else None,
        reasoning=reasoning,
    )


def thinking_budget(req: MessagesRequest) -> int | None:
    """The thinking's bound in tokens: ``enabled``'s `budget_tokens`; 0 for ``disabled`` (a template that
    opens the block anyway has it closed at once); None (no bound) for ``adaptive`` or no `thinking`."""
    if isinstance(req.thinking, ThinkingEnabled):
        return req.thinking.budget_tokens
    if req.thinking is not None and req.thinking.type == "disabled":
        return 0
    return None


def model_not_found(name: str) -> str:
    return f"model: {excerpt(name)}"
