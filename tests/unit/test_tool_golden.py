"""Tool-call answers on the wire, byte for byte: scripted token streams (as a grammar-constrained model
produces them) through the chat encoders, compared with tests/golden/openai_tools/<case>
(`UPDATE_GOLDEN=1` rewrites them). The same streams are reassembled by the `openai` client's own
`ChatCompletionStreamState` into the whole answer's message."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.protocols.openai import encoders as enc
from lmiserve.protocols.openai.chat_encoders import ChatEncoder
from lmiserve.protocols.openai.tool_calls import ToolChatStreamEncoder, tool_answer

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "openai_tools"
CREATED = 1700000000
EOS = "eos"

ONE_CALL = ['{"', "name", '":', ' "', "get", "_weather", '",', ' "', "parameters", '":', ' {"', "city", '":', ' "']
ONE_CALL += ["Par", "is", '",', ' "', "unit", '":', ' "', "c", '"}}', EOS]
TWO_CALLS = ['[{"name":', ' "get_weather",', ' "parameters":', ' {"city":', ' "Paris"}},', ' {"name":', ' "get_time"']
TWO_CALLS += [', "parameters":', " {}}]", EOS]
CONTENT = ['{"', "content", '":', ' "', "Hello", " w\\u00", "e9", 'rld\\n!"', "}", EOS]
CUT = ONE_CALL[:16]  # max_tokens reached inside the arguments

CASES: dict[str, tuple[list[str], bool]] = {  # tokens, streamed
    "stream_call.sse": (ONE_CALL, True),
    "stream_parallel.sse": (TWO_CALLS, True),
    "stream_content.sse": (CONTENT, True),
    "stream_cut.sse": (CUT, True),
    "call.json": (ONE_CALL, False),
    "parallel.json": (TWO_CALLS, False),
    "content.json": (CONTENT, False),
    "cut.json": (CUT, False),
}


def events(tokens: list[str]) -> list[StepEvent]:
    out = []
    text = "".join(t for t in tokens if t != EOS)
    for i, piece in enumerate(tokens):
        token = Token(i, "" if piece == EOS else piece, -0.5, special=piece == EOS)
        finish = None
        if i == len(tokens) - 1:
            reason = FinishReason.EOS_TOKEN if piece == EOS else FinishReason.LENGTH
            finish = Finish(reason, text, len(tokens), "prompt", 7)
        out.append(StepEvent(token, None, finish))
    return out


def call_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def render(tokens: list[str], streamed: bool, *, logprobs: bool = False) -> bytes:
    env = enc.Envelope("tiny", "0.1.0-native", CREATED)
    encoder: ToolChatStreamEncoder | ChatEncoder
    if streamed:
        encoder = ToolChatStreamEncoder(env, logprobs=logprobs, include_usage=True, call_ids=call_ids())
    else:
        encoder = ChatEncoder(env, "prompt", logprobs=logprobs, answer=tool_answer(call_ids=call_ids()))
    return b"".join(encoder.on_event(0, e) for e in events(tokens)) + encoder.close()


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    actual = render(*CASES[name])
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(actual)
    assert path.exists(), f"missing golden {path}: run with UPDATE_GOLDEN=1 and review it"
    assert actual == path.read_bytes()


def test_every_golden_file_has_a_case():
    assert sorted(p.name for p in GOLDEN_DIR.iterdir()) == sorted(CASES)


def chunks(body: bytes) -> list[dict]:
    events = body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


@pytest.mark.parametrize("tokens", [ONE_CALL, TWO_CALLS, CONTENT], ids=["call", "parallel", "content"])
def test_openai_stream_state_reassembles_the_whole_answer(tokens):
    whole = json.loads(render(tokens, False))["choices"][0]
    state = ChatCompletionStreamState()
    for chunk in chunks(render(tokens, True)):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert final.message.role == "assistant"
    assert final.finish_reason == whole["finish_reason"]
    assert final.message.content == whole["message"]["content"]
    calls = [(c.id, c.type, c.function.name, c.function.arguments) for c in final.message.tool_calls or []]
    expected = [
        (c["id"], c["type"], c["function"]["name"], c["function"]["arguments"])
        for c in whole["message"].get("tool_calls", [])
    ]
    assert calls == expected


def test_first_chunk_of_a_call_has_id_type_and_name_then_only_arguments():
    calls = [c["choices"][0]["delta"].get("tool_calls") for c in chunks(render(ONE_CALL, True)) if c["choices"]]
    entries = [entry for call in calls if call for entry in call]
    assert entries[0] == {
        "index": 0,
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in entries[1:])
    assert "".join(e["function"]["arguments"] for e in entries) == '{"city": "Paris", "unit": "c"}'


def test_a_cut_call_is_not_listed_and_the_stream_helper_reports_the_length():
    whole = json.loads(render(CUT, False))["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"] == {"role": "assistant", "content": None}
    strict = {"type": "function", "function": {"name": "get_weather", "parameters": {}, "strict": True}}
    state = ChatCompletionStreamState(input_tools=[strict])
    with pytest.raises(openai.LengthFinishReasonError):
        for chunk in chunks(render(CUT, True)):
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))


def test_logprobs_give_a_chunk_per_token():
    body = chunks(render(ONE_CALL, True, logprobs=True))
    assert len([c for c in body if c["choices"]]) == len(ONE_CALL)
    assert all(c["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5 for c in body if c["choices"])
    whole = json.loads(render(ONE_CALL, False, logprobs=True))["choices"][0]
    assert len(whole["logprobs"]["content"]) == len(ONE_CALL)
