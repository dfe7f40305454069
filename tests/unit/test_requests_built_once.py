"""Requests built once (issue #36): a protocol's parse step returns its engine requests complete and
immutable (frozen `GenerationRequest` and `SamplingParams`): the LoRA adapter, the grammar (`response_format`,
tools, the reasoning block), the logprobs and top tokens are inputs of their construction, never set
afterwards. One function, `select_adapter`, picks the adapter from the places a request names one; the
HTTP side (each protocol's adapter reaching the engine, its 404s): test_adapter_selection_http.py."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

import lmiserve
from lmiserve.config import Settings
from lmiserve.core import request_context
from lmiserve.core.adapters import NOWHERE, Elsewhere, Source, first_named, select_adapter
from lmiserve.core.errors import AdapterNotFound, InvalidRequest, ModelNotFound
from lmiserve.core.limits import TextGenLimits
from lmiserve.core.parameters import Limits
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.request_context import RequestFacts
from lmiserve.protocols.anthropic import parse as anthropic
from lmiserve.protocols.anthropic.schema import MessagesRequest
from lmiserve.protocols.lmi import parse as lmi
from lmiserve.protocols.openai import parse as openai
from lmiserve.protocols.openai.reasoning import Reasoning as OpenAIReasoning
from lmiserve.protocols.openai.responses_request import ResponsesRequest, responses_call
from lmiserve.protocols.openai.schema import ChatRequest, CompletionRequest
from lmiserve.protocols.textgen.reasoning import Reasoning, Thinking
from lmiserve.protocols.tgi.parse import validate
from lmiserve.protocols.tgi.schema import GenerateRequest

LIMITS = TextGenLimits(max_input_tokens=100, max_total_tokens=200)
MESSAGES = [{"role": "user", "content": "hi"}]
ANTHROPIC = {"model": "tiny", "max_tokens": 4, "messages": MESSAGES}
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}}]
HEADER = lmi.SAGEMAKER_ADAPTER_HEADER
ADAPTERS = {"alpha", "beta"}
NAMES = ("tiny",)
TOKENIZER = SimpleNamespace(added_tokens_decoder={}, chat_template="")  # what `Thinking.of` reads of one


def words(text: str) -> int:
    return len(text.split())


def render(messages, tools=None, **options) -> str:
    """A template that opens the reasoning block for the model (as Qwen3's thinking templates do)."""
    return " ".join(str(m.get("content")) for m in messages) + " <think>"


def thinking(kind: type[Reasoning] = Reasoning) -> Thinking:
    found = Thinking.of(kind, Settings(reasoning_parser="qwen3"), TOKENIZER)
    assert found is not None
    return found


def parsed() -> dict[str, GenerationRequest]:
    """One request parsed by each protocol's parse step."""
    tgi = GenerateRequest.model_validate({"inputs": "a b", "parameters": {"max_new_tokens": 2}})
    chat = ChatRequest.model_validate({"messages": MESSAGES})
    completion = CompletionRequest.model_validate({"prompt": "hi"})
    responses = ResponsesRequest.model_validate({"input": "hi"})
    return {
        "tgi": validate(tgi, LIMITS, words, stream=False).request,
        "openai_chat": openai.chat(chat, LIMITS, words, render, "tiny").calls[0].request,
        "openai_completion": openai.completion(completion, LIMITS, words, "tiny").calls[0].request,
        "openai_responses": responses_call(responses, [], LIMITS, words, render, "tiny", stored=False).call.request,
        "anthropic": anthropic.messages(MessagesRequest.model_validate(ANTHROPIC), LIMITS, words, render).call.request,
        "lmi": lmi.parse({"inputs": "hi"}, Limits()).requests[0],
    }


@pytest.mark.parametrize("protocol", sorted(parsed()))
def test_a_parsed_request_is_immutable(protocol):
    request = parsed()[protocol]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.adapter = "alpha"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.params.grammar = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.params.top_n_tokens = 5  # type: ignore[misc]


def test_a_variant_is_derived_not_changed():
    params = SamplingParams(max_new_tokens=4)
    request = GenerationRequest("hi", params, adapter="alpha")
    other = dataclasses.replace(request, params=dataclasses.replace(params, bad_words_ids=[[7]]))
    assert (other.request_id, other.adapter, other.params.max_new_tokens) == (request.request_id, "alpha", 4)
    assert request.params.bad_words_ids == [] and other.params.bad_words_ids == [[7]]


def test_openai_chat_builds_its_request_with_the_adapter_grammar_reasoning_and_top_tokens():
    req = ChatRequest.model_validate(
        {
            "messages": MESSAGES,
            "logprobs": True,
            "top_logprobs": 3,
            "response_format": {"type": "json_object"},
            "reasoning_effort": "none",
            "n": 2,
        }
    )
    call = openai.chat(req, LIMITS, words, render, "tiny", adapter="alpha", thinking=thinking(OpenAIReasoning))
    request = call.calls[0].request
    assert (request.adapter, call.model) == ("alpha", "alpha")  # the answer names the adapter (vLLM's)
    assert request.params.top_n_tokens == call.calls[0].top_n_tokens == 3
    assert request.params.grammar is not None and request.params.grammar.kind == "json_object"
    assert request.params.grammar.after == "</think>"  # the prompt opened the block: the grammar follows it
    assert request.params.thinking is not None and request.params.thinking.tokens == 0  # effort `none`
    assert (request.params.n, request.params.best_of, request.ranked) == (2, 2, False)
    assert isinstance(call.reasoning, OpenAIReasoning) and call.reasoning.inside


def test_the_model_a_chat_request_names_outside_its_body_is_the_answers():
    req = ChatRequest.model_validate({"messages": MESSAGES})
    assert openai.chat(req, LIMITS, words, render, "tiny").model == "tiny"
    assert openai.chat(req, LIMITS, words, render, "tiny", model_name="alias").model == "alias"  # ?adapter=alias


def test_tool_grammar_and_reasoning_are_inputs_of_the_anthropic_request():
    payload = {**ANTHROPIC, "tools": [{"name": "get", "input_schema": {"type": "object"}}]}
    req = MessagesRequest.model_validate({**payload, "tool_choice": {"type": "any"}})
    call = anthropic.messages(req, LIMITS, words, render, thinking=thinking(), adapter="beta")
    params = call.call.request.params
    assert call.call.request.adapter == "beta" and not params.include_stop_str_in_output
    assert params.grammar is not None and params.grammar.after == "</think>"  # the tool grammar, after the block
    assert params.thinking is None  # no `thinking` field: no budget
    assert call.reasoning is not None and call.reasoning.inside


def test_completion_prompt_ids_and_prompt_logprobs_are_built_in():
    req = CompletionRequest.model_validate({"prompt": [5, 6, 7], "echo": True, "logprobs": 2, "max_tokens": 1})
    call = openai.completion(req, LIMITS, words, "tiny", lambda ids: "five six seven", adapter="alpha")
    request = call.calls[0].request
    assert (request.prompt, request.prompt_ids, call.calls[0].input_length) == ("five six seven", [5, 6, 7], 3)
    assert (request.params.top_n_tokens, request.params.prompt_top_n, request.params.decoder_input_details) == (
        2,
        2,
        True,
    )
    assert (request.adapter, call.model) == ("alpha", "alpha")


def test_responses_and_tgi_take_the_adapter_as_an_input():
    req = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "none"}})
    call = responses_call(req, [], LIMITS, words, render, "tiny", stored=False, adapter="beta", thinking=thinking())
    assert call.call.request.adapter == "beta" and call.call.request.params.thinking is not None
    tgi = GenerateRequest.model_validate({"inputs": "a b", "parameters": {"adapter_id": "alpha"}})
    assert validate(tgi, LIMITS, words, stream=False, adapter="alpha").request.adapter == "alpha"


# --- one function picks the adapter ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        ([], None),
        ([Source("adapter_id", "alpha")], "alpha"),  # TGI's parameters.adapter_id, the tensor protocols'
        ([Source("adapters", "alpha"), Source("adapter_id", "beta")], "alpha"),  # LMI's body field first
        ([Source("adapters", None), Source("adapter_id", "beta")], "beta"),
        (
            [Source("adapters", ""), Source("adapter_id", None), Source("adapter", "alpha"), Source(HEADER, "x")],
            "alpha",
        ),
        ([Source("adapter", None), Source(HEADER, "beta")], "beta"),  # SageMaker's adapter header
        ([Source("adapter_id", "tiny"), Source("adapter", "alpha")], None),  # the model's own name decides: base
        ([Source("model", "beta")], "beta"),  # OpenAI's and Anthropic's `model`
    ],
)
def test_select_adapter_takes_the_first_source_that_names_one(sources, expected):
    assert select_adapter(sources, ADAPTERS, NAMES) == expected


def test_an_unknown_or_malformed_name_is_refused_naming_its_source():
    with pytest.raises(AdapterNotFound, match=rf"^`{HEADER}` names adapter `delta`, which is not served$"):
        select_adapter([Source("adapter_id", ""), Source(HEADER, "delta")], ADAPTERS, NAMES)
    with pytest.raises(AdapterNotFound, match=r"\(this model serves no LoRA adapters\)"):
        select_adapter([Source("adapter", "alpha")], None, NAMES)
    with pytest.raises(InvalidRequest, match=r"^`adapters` must be an adapter's name \(a string\)"):
        select_adapter([Source("adapters", {"name": "alpha"})], ADAPTERS, NAMES)


def test_a_field_that_names_models_too_answers_other_names_its_own_way():
    def not_found(name: str) -> str | None:
        raise ModelNotFound(f"model {name}")

    assert select_adapter([Source("model", "alpha")], ADAPTERS, NAMES, other=not_found) == "alpha"
    assert select_adapter([Source("model", "tiny")], ADAPTERS, NAMES, other=not_found) is None
    with pytest.raises(ModelNotFound, match="model delta"):
        select_adapter([Source("model", "delta")], ADAPTERS, NAMES, other=not_found)
    assert select_adapter([Source("model", "delta")], ADAPTERS, NAMES, other=lambda name: None) is None  # `*`


def test_sources_outside_the_protocols_field_go_around_it():
    elsewhere = Elsewhere(Source("adapters", "alpha"), (Source("adapter", "beta"), Source(HEADER, "x")))
    fields = [s.field for s in elsewhere.around(Source("adapter_id", "y"))]
    assert fields == ["adapters", "adapter_id", "adapter", HEADER]
    assert NOWHERE.around(Source("model", "m")) == [Source("model", "m")]
    assert first_named([Source("a", None), Source("b", ""), Source("c", "z")]) == Source("c", "z")
    assert [lmi.adapters_source(v).value for v in ("a", ["a"], [], None)] == ["a", "a", None, None]
    assert lmi.adapters_source(["a", "b"]).value == ["a", "b"]  # no name: refused when chosen


def test_the_selected_adapter_is_noted_once_picked():
    facts = RequestFacts("r1")
    token = request_context.bind(facts)
    try:
        assert select_adapter([Source("adapter_id", "tiny")], ADAPTERS, NAMES) is None
        assert facts.adapter is None
        assert select_adapter([Source("adapter", "beta")], ADAPTERS, NAMES) == "beta"
    finally:
        request_context.unbind(token)
    assert facts.adapter == "beta"


def test_only_select_adapter_resolves_a_name():
    """An adapter's name is resolved in one place: every protocol (and the tensor models) calls
    `select_adapter`, which alone calls `resolve_adapter`."""
    package = Path(lmiserve.__file__).parent
    callers = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name == "resolve_adapter":
                    callers.append(str(path.relative_to(package)))
    assert callers == ["core/adapters.py"]
