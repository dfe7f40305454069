"""TGI and OpenAI formatters on hand-made events: EOS as a special token with its literal text, best_of
ranking by mean logprob, prefill's first logprob null, seed null when greedy, finish-reason mapping."""

from __future__ import annotations

import json

import pytest

from lmiserve.core.errors import IncompleteGeneration
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.protocols.openai import encoders as ofmt
from lmiserve.protocols.openai.chat_encoders import ChatStreamEncoder
from lmiserve.protocols.tgi import encoders as fmt


def finish(text: str, n: int, reason=FinishReason.LENGTH, seed=7, prefill=None) -> Finish:
    return Finish(
        reason=reason, generated_text=text, generated_tokens=n, prompt="Hi", prompt_tokens=2, seed=seed, prefill=prefill
    )


def shape(**kw) -> fmt.AnswerShape:
    base = dict(
        prompt="Hi",
        details=True,
        decoder_input_details=False,
        return_full_text=False,
        top_n_tokens=0,
        sampling=False,
        input_length=2,
    )
    return fmt.AnswerShape(**{**base, **kw})


EOS = Token(2, "", -0.5, special=True)
EVENTS = [
    StepEvent(Token(10, " a", -1.0)),
    StepEvent(EOS, finish=finish(" a", 2, FinishReason.EOS_TOKEN)),
]


def special(token_id: int) -> str:
    return {2: "</s>"}[token_id]


def test_eos_token_has_literal_text_and_is_not_in_generated_text():
    body = fmt.generate_body(fmt.sequences(EVENTS), shape(), special)
    assert body["generated_text"] == " a"
    assert body["details"]["tokens"][-1] == {"id": 2, "text": "</s>", "logprob": -0.5, "special": True}
    assert body["details"]["finish_reason"] == "eos_token" and body["details"]["generated_tokens"] == 2
    assert body["details"]["seed"] is None  # greedy


def test_stream_events_index_from_one_and_null_keys_present():
    stream = fmt.StreamEncoder(shape(details=False), special)
    chunks = [stream.on_event(0, e) for e in EVENTS]
    first, last = (json.loads(c.removeprefix(b"data: ")) for c in chunks)
    assert first == {
        "index": 1,
        "token": {"id": 10, "text": " a", "logprob": -1.0, "special": False},
        "generated_text": None,
        "details": None,
    }
    assert last["index"] == 2 and last["token"]["text"] == "</s>" and last["generated_text"] == " a"
    assert last["details"] is None
    assert all(c.startswith(b"data: {") and c.endswith(b"}\n\n") for c in chunks)


def test_stream_final_details_seed_when_sampling():
    stream = fmt.StreamEncoder(shape(sampling=True, return_full_text=True), special)
    last = json.loads(stream.on_event(0, EVENTS[1]).removeprefix(b"data: "))
    assert last["generated_text"] == "Hi a"
    assert last["details"] == {"finish_reason": "eos_token", "generated_tokens": 2, "seed": 7, "input_length": 2}


def test_best_of_keeps_the_engines_ranking_and_lists_the_others():
    # the engine ranked them (index 0 best); the encoder never re-ranks, whatever the logprobs say
    events = [
        StepEvent(Token(1, "x", -1.0), index=0),
        StepEvent(Token(1, "x", -1.0), index=0),
        StepEvent(Token(1, "x", -1.0), finish=finish("xxx", 3, seed=11), index=0),
        StepEvent(Token(3, "y", -0.5), finish=finish("y", 1, seed=12), index=1),
    ]
    seqs = fmt.sequences(events)
    body = fmt.generate_body(seqs, shape(sampling=True), special)
    assert body["generated_text"] == "xxx" and body["details"]["seed"] == 11
    (other,) = body["details"]["best_of_sequences"]
    assert list(other) == ["generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"]
    assert other["generated_text"] == "y" and other["seed"] == 12


def test_prefill_first_logprob_is_null():
    prefill = (Token(1, "<s>", -9.0, True), Token(5, "Hi", -2.0))
    events = [StepEvent(Token(10, " a", -1.0), finish=finish(" a", 1, prefill=prefill))]
    body = fmt.generate_body(fmt.sequences(events), shape(decoder_input_details=True), special)
    assert body["details"]["prefill"] == [
        {"id": 1, "text": "<s>", "logprob": None},
        {"id": 5, "text": "Hi", "logprob": -2.0},
    ]


def test_details_absent_unless_asked():
    body = fmt.generate_body(fmt.sequences(EVENTS), shape(details=False), special)
    assert body == {"generated_text": " a"}


def test_openai_finish_reasons():
    assert ofmt.finish_reason(finish("", 1, FinishReason.EOS_TOKEN)) == "stop"
    assert ofmt.finish_reason(finish("", 1, FinishReason.LENGTH)) == "length"
    assert ofmt.finish_reason(finish("", 1, FinishReason.STOP_SEQUENCE)) == "stop"  # OpenAI's name, not TGI's


def test_chat_stream_special_token_is_empty_content_with_role():
    env = ofmt.Envelope("m", "fp", 5)
    stream = ChatStreamEncoder(env, logprobs=False, include_usage=True)
    chunks = b"".join(stream.on_event(0, e) for e in EVENTS) + stream.close()
    events = [c for c in chunks.split(b"\n\n") if c]
    assert events[-1] == b"data: [DONE]"
    last_token = json.loads(events[1].removeprefix(b"data: "))
    assert last_token["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert last_token["choices"][0]["finish_reason"] == "stop"
    usage = json.loads(events[2].removeprefix(b"data: "))
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_stream_without_a_final_event_ends_with_an_incomplete_error():
    stream = fmt.StreamEncoder(shape(), special)
    stream.on_event(0, EVENTS[0])
    with pytest.raises(IncompleteGeneration) as info:
        stream.close()
    assert stream.error(info.value) == (
        b'data: {"error":"Incomplete generation stream","error_type":"incomplete_generation_stream"}\n\n'
    )
    stream.on_event(0, EVENTS[1])
    assert stream.close() == b""
