"""Tools and tool messages through real chat templates (the tiny model's tokenizer with several
templates): shown to templates that take them, written into a system prompt for the others, with
fallbacks for templates that reject tool messages or the system role."""

from __future__ import annotations

import pytest

from helpers.tiny_model import CHAT_TEMPLATE, build_tiny_tokenizer
from lmiserve.core.limits import TextGenLimits
from lmiserve.protocols.textgen.chat import ChatRequest
from lmiserve.protocols.textgen.errors import ToolError
from lmiserve.protocols.textgen.served import Served
from lmiserve.protocols.textgen.tools.prompt import render_conversation
from lmiserve.protocols.textgen.tools.spec import tool_spec

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ROUND_TRIP = [
    QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]

TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {{ tools | tojson }}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }} {{ m.name }}]{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STRICT_TEMPLATE = (  # no system role, user/assistant alternate (Mistral-style)
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def renderer(tokenizer, template: str):
    tokenizer.chat_template = template
    return Served(service=None, engine=None, limits=TextGenLimits(), tokenizer=tokenizer).render_chat  # type: ignore[arg-type]


def prompt(render, messages, tools=None, choice=None, parallel=None, tool_prompt=None) -> str:
    req = ChatRequest.model_validate({"messages": messages})
    return render_conversation(req.messages, tool_spec(tools, choice, parallel, tool_prompt), render)


def test_template_without_tools_gets_them_in_a_system_prompt(tokenizer):
    render = renderer(tokenizer, CHAT_TEMPLATE)
    text = prompt(render, [QUESTION], [WEATHER])
    assert text.startswith('<|system|>You can call the following functions:\n{"name": "get_weather"')
    assert 'reply with {"name": <function name>, "parameters": <its arguments>}' in text
    assert "or with a JSON array of such objects to call several." in text
    assert "To answer without calling a function, reply in plain text." in text
    assert text.endswith("<|user|>Weather in Paris?</s><|assistant|>")
    system = prompt(render, [{"role": "system", "content": "Be brief."}, QUESTION], [WEATHER], "required", False)
    assert system.startswith("<|system|>Be brief.\n\nYou can call the following functions:")
    assert "several" not in system and '"content"' not in system
    named = prompt(render, [QUESTION], [WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert 'Call the function get_weather: reply with {"name": "get_weather", "parameters": <its arguments>}.' in named
    custom = prompt(render, [QUESTION], [WEATHER], tool_prompt="Use JSON.")
    assert "Use JSON." in custom and "To call a function" not in custom


def test_no_tools_and_tool_choice_none_render_as_plain_chat(tokenizer):
    render = renderer(tokenizer, CHAT_TEMPLATE)
    plain = render([{"role": "user", "content": "Weather in Paris?"}])
    assert prompt(render, [QUESTION]) == plain
    assert prompt(render, [QUESTION], [WEATHER], "none") == plain


def test_template_with_tools_shows_them_and_tool_messages(tokenizer):
    render = renderer(tokenizer, TOOLS_TEMPLATE)
    text = prompt(render, ROUND_TRIP, [WEATHER])
    assert text.startswith('<|system|>Tools: [{"type": "function", "function": {"name": "get_weather", "descr')
    assert "You can call the following functions" not in text  # the template lists them itself
    assert 'To call a function, reply with {"name"' in text
    assert '<|assistant|><call>get_weather {"city": "Paris"}</call></s>' in text  # arguments as an object
    assert "<|tool|>18 C[call_1 get_weather]</s>" in text  # name found from the call's id
    assert text.endswith("<|assistant|>")


def test_tool_messages_fall_back_to_text_for_templates_that_ignore_them(tokenizer):
    render = renderer(tokenizer, CHAT_TEMPLATE)
    text = prompt(render, ROUND_TRIP, [WEATHER])
    assert '<|assistant|>{"name": "get_weather", "parameters": {"city": "Paris"}}</s>' in text
    assert "<|tool|>18 C</s>" in text  # the template renders a tool role as it is
    parallel = [QUESTION, {"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "call_2"}]}]
    assert '<|assistant|>[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name"' in prompt(
        render, parallel, [WEATHER]
    )


def test_strict_template_gets_results_as_user_and_the_instruction_in_the_first_user_message(tokenizer):
    render = renderer(tokenizer, STRICT_TEMPLATE)
    second = {"role": "tool", "tool_call_id": "call_2", "content": "20 C", "name": "get_weather"}
    messages = [QUESTION, {"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "call_2"}]}, ROUND_TRIP[2], second]
    text = prompt(render, messages, [WEATHER])
    lines = text.split("\n")
    assert lines[0] == "[user] You can call the following functions:"
    assert "[user] Result of get_weather: 18 C" in text and text.endswith("Result of get_weather: 20 C\n")
    # without tools (answering after the results), the conversation alone
    answer = prompt(render, messages)
    assert answer.startswith('[user] Weather in Paris?\n[assistant] [{"name": "get_weather"')


def test_bad_tool_calls_in_messages_are_tool_errors(tokenizer):
    render = renderer(tokenizer, CHAT_TEMPLATE)
    with pytest.raises(ToolError, match=r"`messages\[1\].tool_calls\[0\]` must have a `function`"):
        prompt(render, [QUESTION, {"role": "assistant", "tool_calls": [{"id": "x"}]}])
