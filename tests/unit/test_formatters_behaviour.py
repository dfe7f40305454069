"""Formatter selection, registry, streaming edge cases and the error protocol."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from lmiserve.core.errors import GenerationFailed, IncompleteGeneration
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.protocols.lmi.errors import RENDERER
from lmiserve.protocols.lmi.formatters import (
    DynamicBatchFormatter,
    DynamicBatchStreamFormatter,
    FormatOptions,
    Formatter,
    get_formatter,
    register,
    select_formatter_name,
)
from lmiserve.server.pipeline import DEFAULT_ERROR_MESSAGE, failure_of, is_error_finish

PROMPT = "What is DL?"
DEEP = Token(304, "Deep", -0.05)
LEARNING = Token(11157, " Learning", -1.28)


def done(text="Deep Learning", count=2, reason=FinishReason.LENGTH, error=None) -> Finish:
    return Finish(reason, text, count, PROMPT, 4, error=error)


def opts(**kw) -> FormatOptions:
    return FormatOptions(prompt=PROMPT, **kw)


# --- selection ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_value", "option_value", "stream", "tgi", "expected"),
    [
        (None, None, False, False, "json"),
        (None, None, True, False, "jsonlines"),
        (None, None, True, True, "tgi_sse"),
        (None, None, False, True, "tgi_json"),
        (None, "jsonlines", False, False, "jsonlines"),  # option streams even without "stream"
        (None, "sse", False, False, "sse"),
        (None, "json", True, False, "json"),  # one non-streamed body despite "stream": true
        ("sse", "jsonlines", True, False, "sse"),  # the request wins over the option
        ("json", "sse", True, False, "json"),
        (None, "jsonlines", True, True, "tgi_jsonlines"),  # TGI keys, no data: prefix
        ("tgi_compat", None, False, False, "tgi_json"),
        ("tgi_compat", None, True, False, "tgi_sse"),
        (None, "tgi_compat", True, False, "tgi_sse"),
        ("", "sse", True, False, "sse"),  # empty counts as unset
    ],
)
def test_select_formatter_name(request_value, option_value, stream, tgi, expected) -> None:
    assert select_formatter_name(request_value, option_value, stream, tgi) == expected


@pytest.mark.parametrize(("stream", "tgi", "expected"), [(False, False, "json"), (True, True, "tgi_sse")])
def test_unknown_formatter_warns_and_uses_default_rule(caplog, stream, tgi, expected) -> None:
    with caplog.at_level(logging.WARNING, logger="lmiserve.protocols.lmi.formatters.base"):
        assert select_formatter_name("xml", "jsonlines", stream, tgi) == expected
    assert "Unsupported output formatter: xml" in caplog.text


@pytest.mark.parametrize(
    ("name", "content_type", "streaming", "tgi"),
    [
        ("json", "application/json", False, False),
        ("jsonlines", "application/jsonlines", True, False),
        ("sse", "text/event-stream", True, False),
        ("tgi_json", "application/json", False, True),
        ("tgi_jsonlines", "application/jsonlines", True, True),
        ("tgi_sse", "text/event-stream", True, True),
    ],
)
def test_formatter_classes(name, content_type, streaming, tgi) -> None:
    fmt = get_formatter(name, opts())
    assert (fmt.name, fmt.content_type, fmt.streaming, fmt.details) == (name, content_type, streaming, tgi)
    assert get_formatter(name.removeprefix("tgi_"), opts(tgi_compat=tgi)).name == name


def test_registry_rejects_duplicates_and_unknown_names() -> None:
    with pytest.raises(ValueError):
        register("json")(type("Other", (Formatter,), {}))
    with pytest.raises(KeyError):
        get_formatter("xml", opts())


def test_format_options_for_request() -> None:
    params = SamplingParams(decoder_input_details=True, top_n_tokens=3, n=2, best_of=4)
    o = FormatOptions.for_request(GenerationRequest(PROMPT, params), details=True, tgi_compat=True)
    assert o == FormatOptions(True, False, True, PROMPT, True, 3, 2, 4)


# --- streaming edge cases ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["jsonlines", "sse", "tgi_sse"])
def test_step_without_token_sends_nothing(name) -> None:
    fmt = get_formatter(name, opts())
    assert fmt.on_event(0, StepEvent(None)) == b""
    assert fmt.on_event(0, StepEvent(None, top_tokens=())) == b""
    assert fmt.on_event(0, StepEvent(DEEP)) != b""
    assert fmt.close() == b""


def test_streaming_follows_sequence_zero_only() -> None:
    fmt = get_formatter("jsonlines", opts())
    assert fmt.on_event(0, StepEvent(LEARNING, index=1, finish=done())) == b""
    assert fmt.on_event(0, StepEvent(DEEP)) == b'{"token": {"id": 304, "text": "Deep", "log_prob": -0.05}}\n'


def test_final_event_without_token_still_ends_the_stream() -> None:
    fmt = get_formatter("jsonlines", opts(details=True))
    fmt.on_event(0, StepEvent(DEEP))
    line = fmt.on_event(0, StepEvent(None, finish=done("Deep", 1, FinishReason.ABORT)))
    assert line == (
        b'{"generated_text": "Deep", "details": {"finish_reason": "abort", '
        b'"generated_tokens": 1, "inputs": "What is DL?"}}\n'
    )


def test_tgi_details_default_and_explicit_false() -> None:
    last = StepEvent(LEARNING, finish=done())
    assert b'"details"' in get_formatter("tgi_jsonlines", opts()).on_event(0, last)
    assert b'"details"' not in get_formatter("tgi_jsonlines", opts(details=False)).on_event(0, last)
    assert b'"details"' not in get_formatter("jsonlines", opts()).on_event(0, last)


def test_prompt_falls_back_to_finish_prompt() -> None:
    fmt = get_formatter("json", FormatOptions(details=True, return_full_text=True))
    fmt.on_event(0, StepEvent(DEEP, finish=done("Deep", 1)))
    body = json.loads(fmt.close())
    assert (body["generated_text"], body["details"]["inputs"]) == ("What is DL?Deep", PROMPT)


def test_json_close_requires_finished_sequences() -> None:
    fmt = get_formatter("json", opts())
    fmt.on_event(0, StepEvent(DEEP))
    with pytest.raises(IncompleteGeneration):
        fmt.close()


# --- errors --------------------------------------------------------------------------------------


def test_error_helpers() -> None:
    failed = StepEvent(None, finish=done("Deep", 1, FinishReason.ERROR, error="CUDA out of memory"))
    assert is_error_finish(failed) and failure_of(failed).message == "CUDA out of memory"
    anonymous = StepEvent(None, finish=done("", 0, FinishReason.ERROR))
    assert failure_of(anonymous).message == DEFAULT_ERROR_MESSAGE
    assert not is_error_finish(StepEvent(DEEP)) and not is_error_finish(StepEvent(DEEP, finish=done()))


def drive(fmt: Formatter, events) -> tuple[int, bytes]:
    """The response pipeline's loop (lmiserve/server/pipeline.py) with LMI's renderer."""
    sent: list[bytes] = []
    for event in events:
        if is_error_finish(event):
            if not sent:
                return RENDERER.status(failure_of(event)), RENDERER.body(failure_of(event))
            return 200, b"".join(sent) + fmt.error(failure_of(event))
        chunk = fmt.on_event(0, event)
        if chunk and fmt.streaming:
            sent.append(chunk)
        elif chunk:
            raise AssertionError("a non-streaming formatter sent bytes early")
    return 200, b"".join(sent) + fmt.close()


FAILING = [StepEvent(DEEP), StepEvent(None, finish=done("Deep", 1, FinishReason.ERROR, error="boom"))]


def test_error_before_anything_sent_is_424() -> None:
    for name in ("json", "tgi_json"):
        assert drive(get_formatter(name, opts()), FAILING) == (424, b'{"error":"boom","code":424}')
    assert drive(get_formatter("sse", opts()), FAILING[1:]) == (424, b'{"error":"boom","code":424}')


def test_error_after_streaming_began_is_in_band() -> None:
    line = b'{"token": {"id": 304, "text": "Deep", "log_prob": -0.05}}\n'
    assert drive(get_formatter("jsonlines", opts()), FAILING) == (
        200,
        line + b'{"error":"boom","code":424}\n',
    )
    assert drive(get_formatter("sse", opts()), FAILING) == (
        200,
        b"data: " + line[:-1] + b"\n\ndata: " + b'{"error":"boom","code":424}\n\n',
    )


def test_error_finish_passed_through_renders_finish_reason_error() -> None:
    evs = [StepEvent(DEEP), StepEvent(LEARNING, finish=done(reason=FinishReason.ERROR, error="x"))]
    fmt = get_formatter("jsonlines", opts())
    assert fmt.on_event(0, evs[0]) and fmt.on_event(0, evs[1]).endswith(
        b'"generated_text": "Deep Learning", "details": {"finish_reason": "error"}}\n'
    )
    fmt = get_formatter("json", opts())
    for event in evs:
        fmt.on_event(0, event)
    assert fmt.close() == b'{"generated_text": "Deep Learning", "details": {"finish_reason": "error"}}'


# --- dynamic batch -----------------------------------------------------------------------------


def test_dynamic_batch_stream_is_independent_of_arrival_order() -> None:
    a = [StepEvent(Token(1, "A", 0.0)), StepEvent(Token(2, "B", 0.0), finish=done("AB"))]
    b = [StepEvent(Token(3, "x", 0.0)), StepEvent(None), StepEvent(Token(4, "y", 0.0))]
    b.append(StepEvent(Token(5, "z", 0.0), finish=done("xyz", 3)))
    expected = b'{"outputs": ["A", "x"]}\n{"outputs": ["B", "y"]}\n{"outputs": ["", "z"]}\n'
    tagged = [(0, e) for e in a] + [(1, e) for e in b]
    for order in itertools.permutations(range(len(tagged))):
        if not _keeps_input_order(tagged, order):
            continue
        fmt = DynamicBatchStreamFormatter(2)
        out = b"".join(fmt.on_event(*tagged[i]) for i in order)
        assert out + fmt.close() == expected


def _keeps_input_order(tagged, order) -> bool:
    positions = [[tagged[i][1] for i in order if tagged[i][0] == k] for k in (0, 1)]
    return all(p == [e for j, e in tagged if j == k] for k, p in enumerate(positions))


def test_dynamic_batch_stream_sends_lines_as_soon_as_complete() -> None:
    fmt = DynamicBatchStreamFormatter(2)
    assert fmt.on_event(0, StepEvent(Token(1, "A", 0.0))) == b""
    assert fmt.on_event(1, StepEvent(Token(2, "é", 0.0))) == '{"outputs": ["A", "é"]}\n'.encode()
    assert fmt.error(GenerationFailed("boom")) == b'{"error":"boom","code":424}\n'


def test_dynamic_batch_completion_only_and_missing_finish() -> None:
    fmt = DynamicBatchFormatter(["Hi"], return_full_text=False)
    fmt.on_event(0, StepEvent(Token(5, " there", 0.0), finish=done(" there", 1)))
    assert fmt.close() == b'[{"generated_text": " there"}]'
    assert fmt.content_type == "application/json" and not fmt.streaming
    with pytest.raises(IncompleteGeneration):
        DynamicBatchFormatter(["a", "b"]).close()
