"""The OpenAI Responses API request (POST /v1/responses) -> one validated engine call.

- `input` (`responses_input`): a string (one user message) or a list of items: ``message`` (``type`` may be left out;
  roles ``user``, ``assistant``, ``system``, ``developer``; content a string or ``input_text`` /
  ``output_text`` / ``refusal`` parts), ``function_call`` (``call_id``, ``name``, ``arguments``),
  ``function_call_output`` (``call_id``, ``output``), and ``reasoning`` items given back (left out of
  the prompt, as chat templates leave earlier reasoning out). `instructions` is a system message before
  them. With `previous_response_id` the stored conversation (its input and output items, not its
  instructions) comes first. Everything is rendered with the model's chat template, tools and tool
  messages as on the chat route (`lmiserve.protocols.textgen.tools.prompt`); ``developer`` is given to
  the template as ``system``.
- `tools`: flat function tools ``{"type": "function", "name", "description"?, "parameters"?,
  "strict"?}``; `tool_choice`: ``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function",
  "name"}``; `parallel_tool_calls`. Arguments are always generated under the tool's schema.
- `text.format`: ``text``, ``json_object``, ``json_schema`` (``name``, ``schema``, ``strict``), through
  the grammar engine; `reasoning.effort` reaches the chat template as ``reasoning_effort`` (``none`` also
  as ``enable_thinking: false``) and bounds the thinking (`textgen.reasoning.effort_budget`).
- Sampling: `temperature` (0 greedy), `top_p`, `max_output_tokens`, and the chat route's extensions
  (`seed`, penalties, `top_k`, `min_p`, `logit_bias`, ...: `openai.sampling`).

Unknown fields are accepted and logged once (the chat route's policy); fields OpenAI defines that this
server cannot honour are a 400 naming them (`UNSUPPORTED`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictStr

from lmiserve.core import constraints
from lmiserve.core.errors import ContextLengthExceeded, excerpt
from lmiserve.core.grammar import Grammar
from lmiserve.core.limits import TextGenLimits
from lmiserve.core.media import Image
from lmiserve.protocols.openai import sampling as openai_sampling
from lmiserve.protocols.openai.errors import ContextWindowExceeded, InvalidValue
from lmiserve.protocols.openai.reasoning import Reasoning
from lmiserve.protocols.openai.responses_input import input_items, messages
from lmiserve.protocols.openai.schema import OpenAISampling
from lmiserve.protocols.textgen.parameters import UINT32, UINT64, TextGenParameters
from lmiserve.protocols.textgen.reasoning import Thinking
from lmiserve.protocols.textgen.tools.parsers import ToolParser
from lmiserve.protocols.textgen.tools.prompt import Render, render_conversation
from lmiserve.protocols.textgen.tools.spec import ToolSpec, tool_fields, tool_spec
from lmiserve.protocols.textgen.validation import TextGenCall, check

METADATA_KEYS, METADATA_KEY_LENGTH, METADATA_VALUE_LENGTH = 16, 64, 512  # OpenAI's limits
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


class ResponsesRequest(OpenAISampling):
    """The body of POST /v1/responses (OpenAI's fields, then vLLM's sampling extensions)."""

    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"input": "Say hello.", "max_output_tokens": 8}]}
    )

    model: str | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=UINT32)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=0, le=UINT64)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    # known, honoured only in their default meaning (see `check_unsupported`)
    background: StrictBool | None = None
    include: list[StrictStr] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=UINT32)
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    service_tier: StrictStr | None = None
    # accepted and echoed, without effect here (no billing, the prefix cache needs no key)
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None


@dataclass
class ResponsesCall:
    """A validated Responses request: the engine call and what the answer shows."""

    call: TextGenCall
    prompt: str
    model: str
    stream: bool
    items: list[dict[str, Any]]  # the conversation: the previous response's items, then this input's
    tools: ToolSpec | None  # active tools: the answer is read as function calls
    echo: dict[str, Any]  # the request's parameters as the response object shows them
    reasoning: Reasoning | None = None  # the answer's reasoning block is read (a reasoning parser)


def check_unsupported(req: ResponsesRequest) -> None:
    """A 400 naming each field OpenAI defines that this server cannot honour (beyond its default)."""
    refusals = [
        (req.background, "background", "`background` mode is not supported: leave it out or false"),
        (req.conversation, "conversation", "`conversation` objects are not supported: use `previous_response_id`"),
        (req.prompt, "prompt", "reusable `prompt` templates are not supported"),
        (req.include, "include", "`include` is not supported (no logprobs, no encrypted reasoning)"),
        (req.top_logprobs, "top_logprobs", "`top_logprobs` is not supported on /v1/responses"),
        (req.truncation == "auto", "truncation", '`truncation` "auto" is not supported: only "disabled"'),
        (req.max_tool_calls is not None, "max_tool_calls", "`max_tool_calls` is not supported"),
    ]
    for given, name, message in refusals:
        if given:
            raise InvalidValue(message, name)
    if req.service_tier not in (None, "auto", "default"):
        raise InvalidValue('`service_tier` must be "auto" or "default" on this server', "service_tier")
    metadata = req.metadata or {}
    if len(metadata) > METADATA_KEYS or any(
        len(k) > METADATA_KEY_LENGTH or len(v) > METADATA_VALUE_LENGTH for k, v in metadata.items()
    ):
        raise InvalidValue(
            f"`metadata` holds at most {METADATA_KEYS} pairs, keys of at most {METADATA_KEY_LENGTH} characters "
            f"and values of at most {METADATA_VALUE_LENGTH}",
            "metadata",
        )


# --- tools ------------------------------------------------------------------------------------------


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools in the chat shape `tool_spec` reads; other tool types are a 400."""
    if tools is None:
        return None
    nested = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidValue(
                f"Tool type `{excerpt(str(kind))}` is not supported: only `function` tools",
                f"tools[{i}].type",
            )
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidValue(f"`tools[{i}].strict` must be a boolean", f"tools[{i}].strict")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        nested.append({"type": "function", "function": function})
    return nested


def chat_tool_choice(choice: Any) -> Any:
    """`tool_choice` in the chat shape `tool_spec` reads."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidValue(
        '`tool_choice` must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice"
    )


def echoed_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The tools as the response object lists them (OpenAI's fields, `strict` defaulting to true)."""
    return [
        {
            "type": "function",
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
            "strict": tool.get("strict", True),
        }
        for tool in tools or ()
    ]


# --- text.format and reasoning ----------------------------------------------------------------------


def text_format(text: dict[str, Any] | None) -> tuple[Grammar | None, dict[str, Any]]:
    """The output constraint of `text.format`, and `text` as the response echoes it."""
    fmt = (text or {}).get("format")
    verbosity = (text or {}).get("verbosity")
    if verbosity not in (None, "medium"):
        raise InvalidValue('`text.verbosity` other than "medium" is not supported', "text.verbosity")
    echo = {"format": {"type": "text"}, "verbosity": "medium"}
    if fmt is None:
        return None, echo
    if not isinstance(fmt, dict):
        raise InvalidValue("`text.format` must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None, echo
    if kind == "json_object":
        return Grammar("json_object"), {**echo, "format": {"type": "json_object"}}
    if kind == "json_schema":
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidValue("`text.format.name` is required for a json_schema format", "text.format.name")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidValue("`text.format.schema` must be a JSON Schema object", "text.format.schema")
        strict = fmt.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidValue("`text.format.strict` must be a boolean", "text.format.strict")
        shown: dict[str, Any] = {"type": "json_schema", "name": name, "schema": schema, "strict": bool(strict)}
        if isinstance(fmt.get("description"), str):
            shown["description"] = fmt["description"]
        return constraints.json_schema(schema, "text.format.schema"), {**echo, "format": shown}
    raise InvalidValue(
        f"`text.format.type` `{excerpt(str(kind))}` is not supported: text, json_object or json_schema",
        "text.format.type",
    )


def reasoning_options(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    """`reasoning` as echoed ({effort, summary}); a summary can only be "auto" (none is written)."""
    reasoning = reasoning or {}
    effort, summary = reasoning.get("effort"), reasoning.get("summary")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidValue(f"`reasoning.effort` must be one of {', '.join(REASONING_EFFORTS)}", "reasoning.effort")
    if summary not in (None, "auto"):
        raise InvalidValue('`reasoning.summary` other than "auto" is not supported (no summaries)', "reasoning.summary")
    return {"effort": effort, "summary": summary}


# --- the call ---------------------------------------------------------------------------------------


def _number(value: float | None, default: float) -> float:
    return default if value is None or not math.isfinite(value) else value


def responses_call(
    req: ResponsesRequest,
    history: list[dict[str, Any]],
    limits: TextGenLimits,
    count_tokens: Callable[[str], int],
    render: Render,
    served_model: str,
    *,
    stored: bool,
    parser: ToolParser | None = None,
    adapter: str | None = None,
    thinking: Thinking[Reasoning] | None = None,
    images: tuple[Image, ...] = (),
) -> ResponsesCall:
    """Validate `req` (after `history`, the previous response's items) into one engine call, for the LoRA
    `adapter` (None: the base model) and the model's reasoning parser (`thinking`). `stored`: whether the
    server will keep the response (the `store` echo). `images`: the ``input_image`` parts' images, loaded
    (`count_tokens` counts their tokens)."""
    check_unsupported(req)
    bias = openai_sampling.check(req)
    items = history + input_items(req.input)
    conversation = messages(items, req.instructions)
    tools = tool_spec(chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls, parser=parser)
    grammar, text_echo = text_format(req.text)
    reasoning = reasoning_options(req.reasoning)
    if reasoning["effort"] is not None:
        template_kwargs: dict[str, Any] = {"reasoning_effort": reasoning["effort"]}
        if reasoning["effort"] == "none":  # thinking off, as Qwen3's templates read it
            template_kwargs["enable_thinking"] = False
        render = functools.partial(render, template_kwargs=template_kwargs)
    prompt = render_conversation(conversation, tools, render)
    greedy = req.temperature == 0.0
    params = TextGenParameters(
        do_sample=not greedy,
        temperature=None if greedy else req.temperature,
        top_p=None if req.top_p == 1.0 else req.top_p,
        max_new_tokens=req.max_output_tokens,
        seed=req.seed,
        details=True,
        truncate=None,
    )
    try:
        checked = check(prompt, params, limits, count_tokens, stream=req.stream)
    except ContextLengthExceeded as exc:
        raise ContextWindowExceeded(exc, "input") from None
    fields = {"include_stop_str_in_output": False, "grammar": grammar, **openai_sampling.fields(req, bias)}
    if tools.read:
        fields.update(tool_fields(tools, grammar))
    block = None  # the reasoning parser's
    if thinking is not None:  # a grammar applies after the reasoning block, a budget bounds it
        block = thinking.reasoning(prompt)
        fields.update(thinking.sampling(block, fields["grammar"], thinking.effort_budget(reasoning["effort"])))
    call = checked.call(adapter=adapter, priority=req.priority, cache_salt=req.cache_salt, images=images, **fields)
    model = served_model if req.model in (None, "") else req.model
    echo = {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": reasoning,
        "service_tier": "default",
        "store": stored,
        "temperature": _number(req.temperature, 1.0),
        "text": text_echo,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": echoed_tools(req.tools),
        "top_logprobs": 0,
        "top_p": _number(req.top_p, 1.0),
        "truncation": "disabled",
        "user": req.user,
        "metadata": dict(req.metadata or {}),
    }
    if req.safety_identifier is not None:
        echo["safety_identifier"] = req.safety_identifier
    if req.prompt_cache_key is not None:
        echo["prompt_cache_key"] = req.prompt_cache_key
    return ResponsesCall(call, prompt, model, req.stream, items, tools if tools.read else None, echo, block)
