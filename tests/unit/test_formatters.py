"""LMI formatters: golden wire files and the reference's literal examples.

Goldens live in tests/golden/lmi/, one file per case, exact bytes. `UPDATE_GOLDEN=1 pytest ...`
rewrites them; review the diff against the reference before committing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmiserve.core.errors import GenerationFailed
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.protocols.lmi.errors import (
    dynamic_batch_error_body,
    frontend_error_body,
    lmi_error_body,
)
from lmiserve.protocols.lmi.formatters import (
    DynamicBatchFormatter,
    DynamicBatchStreamFormatter,
    FormatOptions,
    get_formatter,
)

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "lmi"

PROMPT = "What is DL?"
DEEP = Token(304, "Deep", -0.05)
LEARNING = Token(11157, " Learning", -1.28)
IS = Token(338, " is", -0.007)
TOKENS = (DEEP, LEARNING, IS)
PREFILL = (Token(1, "<s>", None), Token(1724, "What", -7.2), Token(338, " is", -1.5))
TOP = (
    (DEEP, Token(450, "The", -3.1)),
    (LEARNING, Token(6509, " learning", -1.9)),
    (IS, Token(29901, ":", -5.25)),
)


def finish(text="Deep Learning is", count=3, reason=FinishReason.LENGTH, **kw) -> Finish:
    return Finish(reason, text, count, PROMPT, 4, **kw)


def events(tokens=TOKENS, fin=None, index=0, top=None) -> list[StepEvent]:
    """One event per token; the last carries the finish (the engine's contract)."""
    out = []
    for i, tok in enumerate(tokens):
        last = i == len(tokens) - 1
        out.append(
            StepEvent(
                tok,
                top_tokens=top[i] if top else None,
                finish=(fin or finish()) if last else None,
                index=index,
            )
        )
    return out


def chunks(name: str, evs, **opts) -> list[bytes]:
    fmt = get_formatter(name, FormatOptions(prompt=PROMPT, **opts))
    out = [fmt.on_event(0, e) for e in evs]
    out.append(fmt.close())
    return out


def render(name: str, evs, **opts) -> bytes:
    return b"".join(chunks(name, evs, **opts))


def best_of_events() -> list[StepEvent]:
    other = finish("Neural nets", 2, FinishReason.EOS_TOKEN)
    second = events((Token(8199, "Neural", -0.9), Token(21447, " nets", -0.4)), other, index=1)
    first = events()
    return [first[0], second[0], first[1], second[1], first[2]]  # interleaved, as the engine does


def unicode_events() -> list[StepEvent]:
    toks = (Token(31999, "Café", -0.5), Token(30488, " 深度", -0.25), Token(243, " 🚀", -0.125))
    return events(toks, finish("Café 深度 🚀"))


def dynamic_batch(prompts, per_input, **kw) -> bytes:
    fmt = DynamicBatchFormatter(prompts, **kw)
    for i, evs in enumerate(per_input):
        for e in evs:
            assert fmt.on_event(i, e) == b""
    return fmt.close()


def dynamic_stream() -> bytes:
    fmt = DynamicBatchStreamFormatter(2)
    a = events((Token(1, "A", -0.1), Token(2, "B", -0.1), Token(3, "C", -0.1)), finish("ABC"))
    b = events((Token(4, "x", -0.1),), finish("x", 1, FinishReason.EOS_TOKEN))
    out = [fmt.on_event(0, a[0]), fmt.on_event(0, a[1]), fmt.on_event(1, b[0]), fmt.on_event(0, a[2])]
    return b"".join(out) + fmt.close()


CASES = {
    "json_default.json": lambda: render("json", events()),
    "json_details.json": lambda: render("json", events(), details=True),
    "json_decoder_input_details.json": lambda: render(
        "json", events(fin=finish(prefill=PREFILL)), details=True, decoder_input_details=True
    ),
    "json_return_full_text.json": lambda: render("json", events(), return_full_text=True),
    "json_top_n_tokens.json": lambda: render("json", events(top=TOP), details=True, top_n_tokens=2),
    "json_tgi.json": lambda: render("tgi_json", events()),
    "json_tgi_details_false.json": lambda: render("tgi_json", events(), details=False),
    "json_best_of.json": lambda: render("json", best_of_events(), best_of=2, n=2),
    "json_best_of_tgi.json": lambda: render("tgi_json", best_of_events(), best_of=2, n=2),
    "json_best_of_single_sequence.json": lambda: render("json", events(), best_of=2),
    "json_unicode.json": lambda: render("json", unicode_events(), details=True),
    "jsonlines_default.jsonl": lambda: render("jsonlines", events()),
    "jsonlines_details.jsonl": lambda: render("jsonlines", events(), details=True),
    "jsonlines_details_prefill_top_tokens.jsonl": lambda: render(
        "jsonlines",
        events(fin=finish(prefill=PREFILL), top=TOP),
        details=True,
        decoder_input_details=True,
        top_n_tokens=2,
    ),
    "jsonlines_return_full_text.jsonl": lambda: render("jsonlines", events(), return_full_text=True),
    "jsonlines_tgi.jsonl": lambda: render("tgi_jsonlines", events()),
    "jsonlines_special_token.jsonl": lambda: render(
        "jsonlines",
        events((DEEP, Token(2, "</s>", -0.01, special=True)), finish("Deep</s>", 2, FinishReason.EOS_TOKEN)),
    ),
    "jsonlines_empty_step.jsonl": lambda: render(
        "jsonlines",
        [StepEvent(None), *events((Token(243, "", -0.3), Token(162, "é", -0.2)), finish("é", 2))],
    ),
    "jsonlines_unicode.jsonl": lambda: render("jsonlines", unicode_events(), details=True),
    "sse_default.sse": lambda: render("sse", events()),
    "sse_tgi.sse": lambda: render("tgi_sse", events()),
    "sse_tgi_special_token.sse": lambda: render(
        "tgi_sse",
        events((DEEP, Token(2, "</s>", -0.01, special=True)), finish("Deep</s>", 2, FinishReason.EOS_TOKEN)),
    ),
    "error_compact.json": lambda: lmi_error_body("exception occurred during rolling batch inference"),
    "error_frontend.json": lambda: frontend_error_body(
        404, "ModelNotFoundException", "Model or workflow not found: foo"
    ),
    "error_tail_jsonlines.jsonl": lambda: (
        b"".join(chunks("jsonlines", events()[:2])[:-1])
        + get_formatter("jsonlines", FormatOptions()).error(GenerationFailed("CUDA out of memory"))
    ),
    "error_tail_sse.sse": lambda: (
        b"".join(chunks("tgi_sse", events()[:2])[:-1])
        + get_formatter("tgi_sse", FormatOptions()).error(GenerationFailed("CUDA out of memory"))
    ),
    "error_dynamic_batch.json": lambda: DynamicBatchFormatter(["Hi"]).error(GenerationFailed("CUDA out of memory")),
    "dynamic_batch_list.json": lambda: dynamic_batch(
        ["Hi", "Bonjour"],
        [events((Token(5, " there", -0.1),), finish(" there", 1)), events((Token(6, " à", -0.2),), finish(" à", 1))],
    ),
    "dynamic_batch_str.json": lambda: dynamic_batch([PROMPT], [events()]),
    "dynamic_batch_stream.jsonl": dynamic_stream,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    data = CASES[name]()
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    assert path.exists(), f"missing golden {path}: run with UPDATE_GOLDEN=1 and review it"
    assert data == path.read_bytes()


def test_every_golden_file_has_a_case() -> None:
    assert {p.name for p in GOLDEN_DIR.iterdir() if not p.name.startswith(".")} == set(CASES)


# --- the reference's literal examples ----------------------------------------------------------

DETAILS = (
    '{"generated_text": "Deep Learning is", "details": {"finish_reason": "length", '
    '"generated_tokens": 3, "inputs": "What is DL?", "tokens": [{"id": 304, "text": "Deep", '
    '"log_prob": -0.05}, {"id": 11157, "text": " Learning", "log_prob": -1.28}, {"id": 338, '
    '"text": " is", "log_prob": -0.007}]}}'
)
TGI = (
    '[{"generated_text": "Deep Learning is", "details": {"finish_reason": "length", '
    '"generated_tokens": 3, "inputs": "What is DL?", "tokens": [{"id": 304, "text": "Deep", '
    '"logprob": -0.05}, {"id": 11157, "text": " Learning", "logprob": -1.28}, {"id": 338, '
    '"text": " is", "logprob": -0.007}]}}]'
)


@pytest.mark.parametrize(
    ("name", "opts", "expected"),
    [
        ("json", {}, '{"generated_text": "Deep Learning is"}'),
        ("json", {"details": True}, DETAILS),
        ("json", {"return_full_text": True}, '{"generated_text": "What is DL?Deep Learning is"}'),
        ("tgi_json", {}, TGI),
        ("json", {"tgi_compat": True}, TGI),
        ("tgi_json", {"details": False}, '[{"generated_text": "Deep Learning is"}]'),
    ],
)
def test_json_reference_examples(name, opts, expected) -> None:
    out = chunks(name, events(), **opts)
    assert out[:-1] == [b"", b"", b""]  # nothing is sent before the end
    assert out[-1] == expected.encode()


def test_json_prefill_follows_tokens() -> None:
    body = render("json", events(fin=finish(prefill=PREFILL)), details=True, decoder_input_details=True)
    assert body.startswith(DETAILS[:-2].encode() + b', "prefill": [')
    # the reference's example, literally
    assert (
        b'"prefill": [{"id": 1, "text": "<s>", "log_prob": null}, {"id": 1724, "text": "What", "log_prob": -7.2}, '
        in body
    )


def test_jsonlines_reference_example() -> None:
    assert chunks("jsonlines", events()) == [
        b'{"token": {"id": 304, "text": "Deep", "log_prob": -0.05}}\n',
        b'{"token": {"id": 11157, "text": " Learning", "log_prob": -1.28}}\n',
        b'{"token": {"id": 338, "text": " is", "log_prob": -0.007}, "generated_text": "Deep Learning is"}\n',
        b"",
    ]
    last = chunks("jsonlines", events(), details=True)[2]
    assert last == (
        b'{"token": {"id": 338, "text": " is", "log_prob": -0.007}, "generated_text": "Deep Learning is", '
        b'"details": {"finish_reason": "length", "generated_tokens": 3, "inputs": "What is DL?"}}\n'
    )


def test_sse_tgi_reference_example() -> None:
    assert render("tgi_sse", events()) == (
        b'data: {"token": {"id": 304, "text": "Deep", "logprob": -0.05}}\n\n'
        b'data: {"token": {"id": 11157, "text": " Learning", "logprob": -1.28}}\n\n'
        b'data: {"token": {"id": 338, "text": " is", "logprob": -0.007}, "generated_text": "Deep Learning is", '
        b'"details": {"finish_reason": "length", "generated_tokens": 3, "inputs": "What is DL?"}}\n\n'
    )


def test_best_of_shape() -> None:
    body = json.loads(render("json", best_of_events(), n=2))
    details = body["details"]
    assert body["generated_text"] == "Deep Learning is"
    assert list(details) == ["inputs", "finish_reason", "generated_tokens", "tokens", "best_of_sequences"]
    (other,) = details["best_of_sequences"]
    assert list(other) == ["finish_reason", "generated_tokens", "tokens", "generated_text"]
    assert (other["finish_reason"], other["generated_tokens"], other["generated_text"]) == (
        "eos_token",
        2,
        "Neural nets",
    )
    # several indexes alone trigger the shape, details on even without "details": true
    assert render("json", best_of_events()) == render("json", best_of_events(), best_of=2, n=2)


def test_error_bodies_reference_examples() -> None:
    reference = (
        '{"error":"Input Parsing failed. Ensure that the request payload is valid. Invalid request '
        "payload. Request payload should be a json object specifying the \\u0027inputs\\u0027 field. "
        'Received payload {\\u0027prompt\\u0027: \\u0027hi\\u0027}","code":424}'
    )
    message = json.loads(reference)["error"]
    body = lmi_error_body(message)
    assert json.loads(body) == json.loads(reference)  # same value; we do not copy Gson's escapes
    assert body == reference.replace("\\u0027", "'").encode()
    assert frontend_error_body(404, "ModelNotFoundException", "Model or workflow not found: foo") == (
        b'{\n  "code": 404,\n  "type": "ModelNotFoundException",\n  "message": "Model or workflow not found: foo"\n}\n'
    )
    assert dynamic_batch_error_body("boom") == (b'{"code": 424, "message": "invoke handler failure", "error": "boom"}')


def test_non_ascii_is_raw_utf8() -> None:
    for name in ("json", "jsonlines", "sse"):
        body = render(name, unicode_events(), details=True)
        assert "深度 🚀".encode() in body and b"\\u" not in body
    assert lmi_error_body("échec") == '{"error":"échec","code":424}'.encode()
