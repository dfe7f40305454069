"""OpenAI chat and completion requests -> validated engine calls.

The sampling fields are checked first with OpenAI's ranges and meaning (`openai.sampling`: additive
presence and frequency penalties, `logit_bias`, vLLM's `top_k`, `min_p`, ...); the lengths, stop
strings and the rest go through TGI's shared checks (`build`). Chat: the messages are rendered with the
tokenizer's chat template (`render`, given by the HTTP layer); ``temperature == 0`` is greedy, any other
value or none samples; ``top_logprobs`` is the number of top tokens. ``n`` > 1 asks the engine for that
many sampled sequences (with a ``seed``, choice i samples from ``seed + i``). Completions: one call per
prompt (at most the engine's ``max_num_seqs``, `TextGenLimits.max_prompts`; TGI's
``max_client_batch_size`` is TGI's own). ``stream_options`` without ``stream`` is a 400, as in vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmiserve.core import constraints
from lmiserve.core.errors import ContextLengthExceeded, InvalidRequest, excerpt
from lmiserve.core.grammar import Grammar
from lmiserve.core.limits import TextGenLimits
from lmiserve.core.media import Image
from lmiserve.protocols.openai import sampling as openai_sampling
from lmiserve.protocols.openai import scoring
from lmiserve.protocols.openai.errors import (
    ContextWindowExceeded,
    FieldError,
    InvalidValue,
    SuffixUnsupported,
    TooManyPrompts,
)
from lmiserve.protocols.openai.reasoning import Reasoning
from lmiserve.protocols.openai.schema import ChatRequest, CompletionRequest
from lmiserve.protocols.textgen.parameters import TextGenParameters
from lmiserve.protocols.textgen.reasoning import Thinking
from lmiserve.protocols.textgen.tools.parsers import ToolParser
from lmiserve.protocols.textgen.tools.prompt import Render, render_conversation
from lmiserve.protocols.textgen.tools.spec import ToolSpec, tool_fields, tool_spec
from lmiserve.protocols.textgen.validation import Checked, TextGenCall, check

MAX_N = 16  # most sequences one request may ask the engine for
# the message roles OpenAI (and vLLM) accept, in the order OpenAI's error message lists them
ROLES = ("system", "assistant", "user", "function", "tool", "developer")


@dataclass
class OpenAICall:
    calls: list[TextGenCall]
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    prompts: list[str] = field(default_factory=list)
    score_only: bool = False  # completions `max_tokens: 0` with `echo`: nothing generated is answered
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` (openai.scoring)
    tools: ToolSpec | None = None  # the answer is read as tool calls (chat with active tools)
    reasoning: Reasoning | None = None  # the answer's reasoning block is read (chat, a reasoning parser)


def _sampling(temperature: float | None) -> dict:
    if temperature == 0.0:
        return {"do_sample": False, "temperature": None}
    return {"do_sample": True, "temperature": temperature}


def _top_p(value: float | None) -> float | None:
    """OpenAI's default top_p=1.0 means "off" (TGI would reject it; everything else is checked as TGI does)."""
    return None if value == 1.0 else value


def _n(n: int, sampling: bool) -> dict[str, Any]:
    """`n` as the engine's fields: that many sequences, not ranked (OpenAI's choices each stream as they
    are generated)."""
    if n == 1:
        return {}
    if n > MAX_N:
        raise InvalidRequest(f"`n` must be <= {MAX_N}. Given: {n}")
    if not sampling:
        raise InvalidRequest("`n` > 1 requires sampling (a `temperature` other than 0)")
    return {"n": n, "best_of": n}


def _call(
    checked: Checked,
    req: ChatRequest | CompletionRequest,
    adapter: str | None,
    *,
    images: tuple[Image, ...] = (),
    **fields: Any,
) -> TextGenCall:
    """The engine request, built once: TGI's checked fields, `fields`, vLLM's scheduling fields (`priority`,
    `cache_salt`) and the adapter; with `n` (`_n`) its sequences are not ranked."""
    ranked = "n" not in fields
    return checked.call(
        adapter=adapter, priority=req.priority, cache_salt=req.cache_salt, ranked=ranked, images=images, **fields
    )


def chat(
    req: ChatRequest,
    limits: TextGenLimits,
    count_tokens: Callable[[str], int],
    render: Render,
    served_model: str,
    parser: ToolParser | None = None,
    *,
    adapter: str | None = None,
    model_name: str | None = None,
    thinking: Thinking[Reasoning] | None = None,
    images: tuple[Image, ...] = (),
) -> OpenAICall:
    """`parser`: the model's tool-call format (None: lmiserve's JSON one); `adapter`: the LoRA adapter that
    answers (and the model the answer names); `model_name`: the model the request names (None: its
    `model`); `thinking`: the model's reasoning parser (None: none); `images`: the messages' images,
    loaded (`count_tokens` counts their tokens)."""
    check_stream_options(req)
    check_roles(req)
    tools = tool_spec(req.tools, req.tool_choice, req.parallel_tool_calls, req.tool_prompt, parser)
    prompt = render_conversation(req.messages, tools, _with_template_kwargs(render, req))
    scoring.check_limit("top_logprobs", req.top_logprobs, limits)
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    bias = openai_sampling.check(req)
    params = TextGenParameters(
        **_sampling(req.temperature),
        top_p=_top_p(req.top_p),
        max_new_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        stop=req.stop or [],
        seed=req.seed,
        details=True,
        truncate=_truncate(req, limits),
    )
    try:
        checked = check(prompt, params, limits, count_tokens, stream=req.stream)
    except ContextLengthExceeded as exc:
        raise ContextWindowExceeded(exc, "messages") from None
    fields = _vllm_fields(checked, req)
    fields["top_n_tokens"] = top_n  # limited by max_logprobs (checked above)
    fields.update(scoring.chat_prompt_logprobs(req, limits))
    fields.update(openai_sampling.fields(req, bias))
    fields.update(_n(req.n or 1, checked.sampling))
    if tools.read:
        fields.update(tool_fields(tools, fields["grammar"]))
    reasoning = None
    if thinking is not None:  # a grammar applies after the reasoning block, a budget bounds it
        reasoning = thinking.reasoning(prompt)
        fields.update(thinking.sampling(reasoning, fields["grammar"], thinking.effort_budget(req.reasoning_effort)))
    return OpenAICall(
        calls=[_call(checked, req, adapter, images=images, **fields)],
        tools=tools if tools.read else None,
        reasoning=reasoning,
        model=adapter or _response_model(req.model if model_name is None else model_name, served_model),
        stream=req.stream,
        include_usage=req.include_usage,
        logprobs=bool(req.logprobs),
        top_logprobs=top_n,
        prompts=[prompt],
        prompt_logprobs=req.prompt_logprobs,
    )


def check_stream_options(req: ChatRequest | CompletionRequest) -> None:
    """vLLM's 400 for `stream_options` on a request that does not stream (``null`` and ``{}`` are not
    "defined", as vLLM reads them)."""
    if req.stream_options_defined and not req.stream:
        raise FieldError("Stream options can only be defined when `stream=True`.", "stream_options")


def check_roles(req: ChatRequest) -> None:
    """`InvalidValue` (400, OpenAI's message) for the first message whose role OpenAI does not accept."""
    for i, message in enumerate(req.messages):
        if message.role not in ROLES:
            allowed = ", ".join(f"'{r}'" for r in ROLES[:-1]) + f", and '{ROLES[-1]}'"
            raise InvalidValue(
                f"Invalid value: '{excerpt(message.role)}'. Supported values are: {allowed}.", f"messages[{i}].role"
            )


def _truncate(req: ChatRequest | CompletionRequest, limits: TextGenLimits) -> int | None:
    """vLLM's `truncate_prompt_tokens` as the prompt tokens kept (the last ones): -1 is as many as the
    model takes; more than it takes is a 400."""
    value = req.truncate_prompt_tokens
    if value is None:
        return None
    if value == -1:
        return limits.max_input_tokens
    if value == 0 or value > limits.max_input_tokens:
        raise InvalidValue(
            f"`truncate_prompt_tokens` must be -1 or between 1 and {limits.max_input_tokens}. Given: {value}",
            "truncate_prompt_tokens",
        )
    return value


def _with_template_kwargs(render: Render, req: ChatRequest) -> Render:
    """`render` given vLLM's `chat_template_kwargs` and `reasoning_effort` (as the template variable of that
    name, unless `chat_template_kwargs` sets it; ``none`` also as ``enable_thinking: false``),
    `add_generation_prompt` and `continue_final_message`, when the request has them."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if req.reasoning_effort == "none":  # thinking off, as Qwen3's templates read it
            kwargs.setdefault("enable_thinking", False)
    if req.add_generation_prompt and req.continue_final_message:
        raise InvalidRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise InvalidRequest("`continue_final_message` needs the last message to be the assistant's.")
    flags: dict[str, Any] = {}
    if not req.add_generation_prompt:
        flags["add_generation_prompt"] = False
    if req.continue_final_message:
        flags["continue_final_message"] = True
    if kwargs:
        flags["template_kwargs"] = kwargs
    return functools.partial(render, **flags) if flags else render


def completion(
    req: CompletionRequest,
    limits: TextGenLimits,
    count_tokens: Callable[[str], int],
    served_model: str,
    decode: scoring.Decode | None = None,
    *,
    adapter: str | None = None,
) -> OpenAICall:
    """`decode`: token ids -> text, for prompts given as token ids (openai.scoring); `adapter`: the LoRA
    adapter that answers (and the model the answer names)."""
    check_stream_options(req)
    prompts = scoring.prompts(req.prompt, decode)
    if "suffix" in req.model_fields_set:
        raise SuffixUnsupported("Suffix is not supported and can be achieved by preprocessing the prompt.")
    if len(prompts) > limits.max_prompts:
        raise TooManyPrompts(
            f"Number of prompts exceeds the maximum allowed batch size of {limits.max_prompts} "
            "(the server's max_rolling_batch_size, vLLM's max_num_seqs)"
        )
    scoring.check(req, limits)
    top_n = req.logprobs or 0
    bias = openai_sampling.check(req)
    calls = []
    for prompt in prompts:
        params = TextGenParameters(
            **_sampling(req.temperature),
            top_p=_top_p(req.top_p),
            max_new_tokens=scoring.max_new_tokens(req),
            stop=req.stop or [],
            seed=req.seed,
            details=True,
            truncate=_truncate(req, limits),
        )
        try:
            checked = check(prompt.checked_text, params, limits, prompt.counter(count_tokens), stream=req.stream)
        except ContextLengthExceeded as exc:
            raise ContextWindowExceeded(exc, "prompt") from None
        fields = {**_vllm_fields(checked, req), **scoring.logprob_fields(req, top_n)}
        fields.update(openai_sampling.fields(req, bias))
        fields.update(_n(req.n or 1, checked.sampling))
        ids: dict[str, Any] = {} if prompt.ids is None else {"prompt": prompt.text, "prompt_ids": list(prompt.ids)}
        calls.append(_call(checked, req, adapter, **ids, **fields))
    return OpenAICall(
        calls=calls,
        model=adapter or served_model,  # completions never echo the requested model (an adapter's name, vLLM's)
        stream=req.stream,
        include_usage=req.include_usage,
        logprobs=req.logprobs is not None,
        top_logprobs=top_n,
        echo=req.echo,
        prompts=[prompt.text for prompt in prompts],
        score_only=scoring.score_only(req),
        prompt_logprobs=req.prompt_logprobs,
    )


def _response_model(requested: str | None, served: str) -> str:
    return served if requested in (None, "", "tgi") else requested


def _vllm_fields(checked: Checked, req: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """vLLM's `ignore_eos` and `min_tokens` (benchmark clients use them to force exactly N tokens), its
    stop fields (`include_stop_str_in_output`: OpenAI leaves the stop string out; `stop_token_ids`), and
    the output constraint: `response_format` or vLLM's `guided_*` / `structured_outputs` (one at most),
    as the engine's `SamplingParams` fields. (Its scheduling fields, `priority` and `cache_salt`: `_call`.)"""
    return {
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "stop_token_ids": list(req.stop_token_ids or ()),
        "ignore_eos_token": req.ignore_eos,
        "min_new_tokens": min(req.min_tokens, checked.params.max_new_tokens),
        "grammar": output_constraint(req),
    }


def output_constraint(req: ChatRequest | CompletionRequest) -> Grammar | None:
    """The request's structured-output constraint (`InvalidRequest` when malformed or several)."""
    vllm = constraints.from_vllm(
        {name: getattr(req, name) for name in (*constraints.VLLM_FIELDS, "structured_outputs")}
    )
    return constraints.only_one(constraints.from_response_format(req.response_format), vllm)
