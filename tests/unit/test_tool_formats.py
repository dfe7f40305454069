"""The model's own tool-call format through the serving layer: `tool_call_parser` (auto from the chat
template), the prompt (tools given to the template, no JSON instruction), `tool_choice` as OpenAI defines
it (``auto`` free, ``required``/named under the format's grammar, ``none`` calls nothing), and the answer
parsed whole and streamed on OpenAI's chat, Anthropic's messages and the Responses API (the fake engine:
scripted model output, the grammar enforced on it)."""

from __future__ import annotations

import functools
import json
import typing
from pathlib import Path

import pytest

from helpers.text_app import Script, text_app, tiny_tokenizer
from helpers.tiny_model import build_tiny_tokenizer
from lmiserve.config.settings import Settings, ToolCallParser
from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.chat import Message
from lmiserve.protocols.textgen.tools.parsers import NAMES, detect, for_tokenizer, token_literal, tool_parser
from lmiserve.protocols.textgen.tools.prompt import render_conversation
from lmiserve.protocols.textgen.tools.spec import tool_grammar, tool_spec

HERMES = (Path(__file__).resolve().parents[1] / "helpers" / "chat_templates" / "hermes.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'


@functools.cache
def hermes_tokenizer():
    """The tiny tokenizer with the Hermes template (its own copy: the shared one keeps its template)."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = HERMES
    return tokenizer


def test_the_settings_take_every_parser_name():
    assert set(typing.get_args(ToolCallParser)) == set(NAMES)
    assert Settings.from_options({"tool_call_parser": "Hermes"}).tool_call_parser == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        Settings.from_options({"tool_call_parser": "hermes2"})


def test_auto_reads_the_template():
    assert detect(HERMES) == "hermes"
    assert detect("{{ messages }}") == "json" and detect(None) == "json"
    assert detect("{%- if tool_call %}[TOOL_CALLS]{{ tool_call | tojson }}{% endif %}") == "mistral"
    assert detect("<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>") == "qwen3_coder"
    assert detect("{{- '<|python_start|>' }}") == "llama4_pythonic"
    assert detect("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    tokenizer = hermes_tokenizer()
    parser = for_tokenizer("auto", tokenizer, "tiny")
    assert parser.name == "hermes" and for_tokenizer("auto", tokenizer) is parser  # resolved once
    assert for_tokenizer("mistral", tiny_tokenizer()).name == "mistral"


def test_a_marker_that_is_one_added_token_is_matched_as_that_token():
    tokenizer = build_tiny_tokenizer()  # not the shared one: a token is added
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    lit = token_literal(tokenizer)
    token = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    assert lit("[TOOL_CALLS]") == f"<[{token}]>" and lit("<tool_call>") == '"<tool_call>"'


@pytest.mark.parametrize("name", [n for n in NAMES if n != "auto"])
def test_every_formats_required_and_named_grammars_compile(name):
    from helpers.text_app import _grammars

    compiler = _grammars(tiny_tokenizer())
    parser = tool_parser(name)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        spec = tool_spec([WEATHER], choice, None, parser=parser)
        grammar = tool_grammar(spec)
        assert isinstance(grammar, Grammar)
        compiler.compile(grammar)  # a 400 (InvalidRequest) if the format's grammar were malformed
    assert tool_grammar(tool_spec([WEATHER], "auto", None, parser=parser)) is None  # auto is free
    assert tool_grammar(tool_spec([WEATHER], "none", None, parser=parser)) is None


def render_with():
    tokenizer = hermes_tokenizer()

    def render(messages, tools=None):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    return render


def test_a_native_format_gets_its_template_and_no_json_instruction():
    render = render_with()
    messages = [Message(role="user", content="Weather in Paris?")]
    for choice in ("auto", "required", "none"):  # "none" hides nothing: the tools are still shown
        text = render_conversation(messages, tool_spec([WEATHER], choice, None, parser=tool_parser("hermes")), render)
        assert '"name": "get_weather"' in text and "<tools>" in text, choice
        assert '"parameters": <' not in text and "reply" not in text, choice
    plain = render_conversation(messages, tool_spec([WEATHER], "none", None), render)  # lmiserve's JSON format
    assert "get_weather" not in plain


@pytest.fixture
def hermes():
    return text_app(tokenizer=hermes_tokenizer(), max_context=4096)


async def post(served, path: str, payload):
    async with served.client() as http:
        return await http.post(path, json=payload)


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], **extra}


async def test_auto_parses_the_models_own_call_whole_and_streamed(hermes):
    hermes.fake.reply(Script(text=f"Let me check.\n{CALL}"))
    choice = (await post(hermes, "/v1/chat/completions", chat(max_tokens=100))).json()["choices"][0]
    assert hermes.fake.requests[-1].params.grammar is None  # auto: nothing forces a call or text
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS} and call["id"].startswith("call_")
    assert choice["message"]["content"] == "Let me check.\n" and choice["finish_reason"] == "tool_calls"

    r = await post(hermes, "/v1/chat/completions", chat(max_tokens=100, stream=True))
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(p["function"]["arguments"] for p in pieces) == ARGUMENTS
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check.\n"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_auto_lets_the_model_answer_in_text(hermes):
    hermes.fake.reply(Script(text="I am fine, thank you."))
    choice = (await post(hermes, "/v1/chat/completions", chat(max_tokens=100))).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "I am fine, thank you."}
    assert choice["finish_reason"] == "stop"


async def test_required_generates_the_formats_syntax(hermes):
    hermes.fake.reply(Script(text=CALL))  # the model ends after its call (the grammar would allow another)
    choice = (await post(hermes, "/v1/chat/completions", chat(tool_choice="required", max_tokens=200))).json()
    [call] = choice["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert hermes.fake.requests[-1].params.grammar.kind == "ebnf"  # the Hermes syntax, not one JSON shape
    hermes.fake.reply(Script(text='{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'))
    r = await post(hermes, "/v1/chat/completions", chat(tool_choice="required", max_tokens=200))
    assert r.status_code == 500 and "does not follow the grammar" in r.json()["error"]["message"]


async def test_none_calls_nothing_and_hides_nothing(hermes):
    hermes.fake.reply(Script(text=CALL))
    choice = (await post(hermes, "/v1/chat/completions", chat(tool_choice="none", max_tokens=100))).json()
    assert choice["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert choice["choices"][0]["finish_reason"] == "stop"


async def test_anthropic_tool_use_and_responses_function_calls_come_from_the_same_parse(hermes):
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    hermes.fake.reply(Script(text=f"Let me check.\n{CALL}"))
    body = {"model": "tiny", "max_tokens": 100, "messages": [{"role": "user", "content": "Paris?"}], "tools": [tool]}
    message = (await post(hermes, "/v1/messages", body)).json()
    assert [b["type"] for b in message["content"]] == ["text", "tool_use"]
    assert message["content"][1]["input"] == {"city": "Paris", "unit": "celsius"}
    assert message["stop_reason"] == "tool_use"
    response = (
        await post(hermes, "/v1/responses", {"input": "Paris?", "tools": [{**WEATHER["function"], "type": "function"}]})
    ).json()
    [call] = [item for item in response["output"] if item["type"] == "function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "unit": "celsius"}


async def test_auto_can_be_switched_off_as_in_vllm():
    served = text_app(max_context=4096, enable_auto_tool_choice=False)
    r = await post(served, "/v1/chat/completions", chat(max_tokens=10))
    assert r.status_code == 400 and "enable_auto_tool_choice" in r.json()["error"]["message"]
    served.fake.reply(Script(text='{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}}', eos=False))
    assert (await post(served, "/v1/chat/completions", chat(tool_choice="required", max_tokens=100))).status_code == 200


HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]


@functools.cache
def harmony_tokenizer():
    """The tiny tokenizer with gpt-oss's special tokens and a template showing its channels."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = (
        "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
        "{# <|channel|>commentary, <|channel|>final<|message|> #}<|start|>assistant"
    )
    return tokenizer


async def test_gpt_oss_channels_are_read_with_tools_or_not():
    served = text_app(tokenizer=harmony_tokenizer(), max_context=4096, reasoning_parser="openai_gptoss")
    analysis = "<|channel|>analysis<|message|>The user greets me.<|end|>"
    served.fake.reply_once(Script(text=f"{analysis}<|start|>assistant<|channel|>final<|message|>Hello!"))
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100}
    choice = (await post(served, "/v1/chat/completions", body)).json()["choices"][0]
    assert served.fake.requests[-1].params.skip_special_tokens is False  # the channels are special tokens
    assert choice["message"]["content"] == "Hello!"
    assert choice["message"]["reasoning_content"] == "The user greets me."
    call = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    served.fake.reply_once(Script(text=f'{analysis}{call}{{"city": "Paris", "unit": "celsius"}}<|call|>'))
    choice = (await post(served, "/v1/chat/completions", chat(max_tokens=200))).json()["choices"][0]
    [made] = choice["message"]["tool_calls"]
    assert made["function"]["name"] == "get_weather" and json.loads(made["function"]["arguments"])["city"] == "Paris"
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
