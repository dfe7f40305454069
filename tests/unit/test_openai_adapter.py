"""OpenAI requests mapped onto TGI's generation parameters and validation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lmiserve.core.errors import InvalidRequest, LmiServeError, TemplateError
from lmiserve.core.grammar import Grammar
from lmiserve.core.limits import TextGenLimits as TgiLimits
from lmiserve.protocols.openai import parse as adapter
from lmiserve.protocols.openai.errors import RENDERER
from lmiserve.protocols.openai.schema import ChatRequest, CompletionRequest
from lmiserve.protocols.textgen.errors import ToolError
from lmiserve.protocols.textgen.served import Served

LIMITS = TgiLimits(max_input_tokens=100, max_total_tokens=200)
MESSAGES = [{"role": "user", "content": "hi"}]


def words(text: str) -> int:
    return len(text.split())


def render(messages, tools=None) -> str:  # a template that does not show tools
    return " ".join(f"{m['role']}: {m['content']}" for m in messages)


def chat(**fields):
    return adapter.chat(ChatRequest.model_validate({"messages": MESSAGES, **fields}), LIMITS, words, render, "served")


def complete(**fields):
    return adapter.completion(CompletionRequest.model_validate({"prompt": "hi", **fields}), LIMITS, words, "served")


def test_chat_defaults_sample_and_fill_the_budget():
    call = chat()
    params = call.calls[0].request.params
    assert params.do_sample and params.temperature == 1.0
    assert params.max_new_tokens == 200 - 2 and call.model == "served"
    assert call.calls[0].request.prompt == "user: hi"


def test_temperature_zero_is_greedy():
    assert not chat(temperature=0).calls[0].request.params.do_sample


def test_mappings():
    params = (
        chat(
            presence_penalty=0.5,
            top_logprobs=3,
            logprobs=True,
            max_tokens=5,
            max_completion_tokens=7,
            stop="x",
            seed=3,
            top_p=1.0,
        )
        .calls[0]
        .request.params
    )
    assert params.presence_penalty == 0.5 and params.repetition_penalty == 1.0  # OpenAI's additive penalty
    assert params.top_n_tokens == 3 and params.max_new_tokens == 7 and params.stop_sequences == ["x"]
    assert params.seed == 3 and params.top_p == 1.0  # OpenAI's top_p=1.0 means off
    assert chat(top_logprobs=3).calls[0].request.params.top_n_tokens == 0  # only with logprobs=true


def test_model_echo():
    assert chat(model="mine").model == "mine" and chat(model="tgi").model == "served"


def rendered(exc: LmiServeError) -> tuple[int, str, str]:
    body = json.loads(RENDERER.body(exc))
    return RENDERER.status(exc), body["error"]["type"], body["error"]["message"]


def test_n_needs_sampling_and_takes_a_seed():
    params = chat(n=3).calls[0].request.params
    assert (params.n, params.best_of) == (3, 3)
    with pytest.raises(InvalidRequest, match="requires sampling"):
        chat(n=2, temperature=0)
    params = chat(n=2, seed=1).calls[0].request.params  # choice i samples from seed + i (the engine)
    assert (params.n, params.seed) == (2, 1)


def test_openai_and_vllm_sampling_fields():
    fields = {
        "presence_penalty": -1.5,
        "frequency_penalty": 2,
        "repetition_penalty": 1.2,
        "top_k": 5,
        "min_p": 0.1,
        "logit_bias": {"7": 100, "12": -100},
        "bad_words": ["fox"],
        "skip_special_tokens": False,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [3],
    }
    for call in (chat(**fields), complete(**fields)):
        p = call.calls[0].request.params
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-1.5, 2.0, 1.2)
        assert (p.top_k, p.min_p, p.logit_bias, p.bad_words) == (5, 0.1, {7: 100.0, 12: -100.0}, ["fox"])
        assert not p.skip_special_tokens and p.ignore_eos_token and p.stop_token_ids == [3]
        assert p.min_new_tokens == 2
    for off in (-1, 0):
        assert chat(top_k=off).calls[0].request.params.top_k == 0
    defaults = chat().calls[0].request.params
    assert defaults.skip_special_tokens and defaults.logit_bias == {} and defaults.presence_penalty == 0.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": 5}, "`temperature` must be in [0, 2], got 5"),
        ({"temperature": -0.1}, "`temperature` must be in [0, 2], got -0.1"),
        ({"top_p": 0}, "`top_p` must be in (0, 1], got 0"),
        ({"top_p": 1.5}, "`top_p` must be in (0, 1], got 1.5"),
        ({"presence_penalty": 2.5}, "`presence_penalty` must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "`frequency_penalty` must be in [-2, 2], got -3"),
        ({"min_p": 1.5}, "`min_p` must be in [0, 1], got 1.5"),
        ({"top_k": -2}, "`top_k` must be -1 or 0 (disabled), or at least 1, got -2"),
        ({"repetition_penalty": 0}, "`repetition_penalty` must be greater than zero, got 0"),
        ({"logit_bias": {"5": 101}}, "`logit_bias` values must be in [-100, 100], got 101 for token 5"),
        ({"logit_bias": {"abc": 1}}, "`logit_bias` keys must be token ids (non-negative integers), got 'abc'"),
        ({"logit_bias": {"-3": 1}}, "`logit_bias` keys must be token ids (non-negative integers), got '-3'"),
    ],
)
def test_openai_ranges_are_400_naming_the_field(fields, message):
    for make in (chat, complete):
        with pytest.raises(InvalidRequest) as info:
            make(**fields)
        assert info.value.message == message
        body = json.loads(RENDERER.body(info.value))["error"]
        assert RENDERER.status(info.value) == 400 and body["param"] == next(iter(fields))


def test_tools_constrain_the_output_to_calls():
    call = chat(tools=[{"type": "function", "function": {"name": "f"}}])
    assert call.tools is not None and call.tools.mode == "auto"
    assert call.calls[0].request.params.grammar is None  # auto: the model answers or calls, nothing forces it
    required = chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required")
    grammar = required.calls[0].request.params.grammar
    assert grammar is not None and grammar.kind == "json_schema" and '"const": "f"' in grammar.value
    assert '"name": "f"' in call.calls[0].request.prompt  # listed for a template that does not show tools
    none = chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    assert none.tools is None and none.calls[0].request.params.grammar is None
    assert none.calls[0].request.prompt == "user: hi"
    with pytest.raises(ToolError) as info:
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="g")
    assert rendered(info.value) == (400, "invalid_request_error", "Tool error: Tool with name g not found")


def test_tools_and_a_response_format_are_mutually_exclusive():
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(ToolError) as info:
        chat(tools=tools, response_format={"type": "json_object"})
    assert rendered(info.value) == (
        400,
        "invalid_request_error",
        "Tool error: Grammar and tools are mutually exclusive",
    )
    with pytest.raises(ToolError):
        chat(tools=tools, guided_regex="a+")
    plain = chat(tools=tools, tool_choice="required", response_format={"type": "text"})  # no constraint
    grammar = plain.calls[0].request.params.grammar
    assert grammar is not None and '"const": "f"' in grammar.value
    none = chat(tools=tools, tool_choice="none", response_format={"type": "json_object"})
    assert none.calls[0].request.params.grammar is not None and none.tools is None


def test_response_format_is_the_grammar():
    # response_format is supported now (structured output): it becomes the request's grammar
    assert chat(response_format={"type": "json_object"}).calls[0].request.params.grammar == Grammar("json_object")
    with pytest.raises(InvalidRequest, match="response_format"):
        chat(response_format={"type": "yaml"})


def test_completion_prompts_echo_and_logprobs():
    req = CompletionRequest.model_validate({"prompt": ["a", "b c"], "echo": True, "logprobs": 9, "max_tokens": 2})
    call = adapter.completion(req, LIMITS, words, "served")
    assert [c.request.prompt for c in call.calls] == ["a", "b c"]
    assert all(c.request.params.decoder_input_details for c in call.calls)  # echo + logprobs: prompt logprobs
    assert call.top_logprobs == 9  # max_logprobs (20) is the limit, not TGI's max_top_n_tokens
    assert all(c.request.params.prompt_top_n == 9 and c.request.params.top_n_tokens == 9 for c in call.calls)
    with pytest.raises(InvalidRequest, match="max_logprobs"):
        adapter.completion(req.model_copy(update={"logprobs": 21}), LIMITS, words, "served")


def test_completion_token_id_prompts():
    req = CompletionRequest.model_validate({"prompt": [[5, 6], [7]], "max_tokens": 2})
    call = adapter.completion(req, LIMITS, words, "served", lambda ids: " ".join(f"t{i}" for i in ids))
    assert [c.request.prompt_ids for c in call.calls] == [[5, 6], [7]]
    assert [c.request.prompt for c in call.calls] == call.prompts == ["t5 t6", "t7"]
    assert [c.input_length for c in call.calls] == [2, 1]
    one = adapter.completion(CompletionRequest.model_validate({"prompt": [5, 6, 7]}), LIMITS, words, "s", str)
    assert [c.request.prompt_ids for c in one.calls] == [[5, 6, 7]]


def test_template_errors():
    no_template = Served(service=None, engine=None, limits=LIMITS, tokenizer=SimpleNamespace(chat_template=None))
    with pytest.raises(TemplateError) as info:
        no_template.render_chat(MESSAGES)
    assert rendered(info.value) == (400, "invalid_request_error", "Template error: template not found")

    def broken(*args, **kwargs):
        raise ValueError("unknown role")

    bad = Served(
        service=None,
        engine=None,
        limits=LIMITS,
        tokenizer=SimpleNamespace(chat_template="x", apply_chat_template=broken),
    )
    with pytest.raises(TemplateError) as info:
        bad.render_chat(MESSAGES)
    assert rendered(info.value) == (400, "invalid_request_error", "Template error: unknown role")


class BosTokenizer:
    """A template that writes BOS itself, and a tokenizer that also adds it (Llama style)."""

    chat_template = "{{ bos_token }}..."
    bos_token, bos_token_id = "<s>", 1

    def __init__(self, adds_bos: bool):
        self.adds_bos = adds_bos

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "<s>[INST] " + messages[0]["content"] + " [/INST]"

    def __call__(self, text):
        return {"input_ids": ([1] if self.adds_bos else []) + [5] * len(text.split())}


def test_bos_appears_once_in_what_the_engine_sees():
    served = Served(service=None, engine=None, limits=LIMITS, tokenizer=BosTokenizer(adds_bos=True))
    assert served.render_chat(MESSAGES) == "[INST] hi [/INST]"  # the engine's tokenizer adds <s>
    assert served.render_chat(MESSAGES, for_engine=False) == "<s>[INST] hi [/INST]"  # /chat_tokenize
    plain = Served(service=None, engine=None, limits=LIMITS, tokenizer=BosTokenizer(adds_bos=False))
    assert plain.render_chat(MESSAGES) == "<s>[INST] hi [/INST]"
