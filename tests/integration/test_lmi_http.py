"""LMI inference over real HTTP: formatters, details, stop sequences,
seeds, max_new_tokens, and greedy output equal to `model.generate` — also under concurrency."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.tiny_model import NON_ASCII_SAMPLE

PROMPT = "Deep learning is"
PROMPTS = ["Hello world", "The quick brown fox", "Deep learning is"]


def is_lmi_json(raw: str) -> bool:
    """Python json.dumps(ensure_ascii=False) spelling: ", " / ": " separators, raw UTF-8."""
    return raw == json.dumps(json.loads(raw), ensure_ascii=False)


def token_texts(lines: list[dict]) -> str:
    return "".join(line["token"]["text"] for line in lines if "token" in line)


def hf_greedy(tiny_model, prompt: str, max_new_tokens: int) -> list[int]:
    """What transformers' own greedy decoding produces, in process, on the same model directory."""
    tokenizer = tiny_model.tokenizer
    encoded = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = tiny_model.model.generate(
            **encoded, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
        )
    return out[0, encoded["input_ids"].shape[1] :].tolist()


def ids_of(body: dict) -> list[int]:
    return [t["id"] for t in body["details"]["tokens"]]


# --- json (default, non-streaming) ------------------------------------------------------------------


def test_json_default_body_is_exactly_generated_text(server):
    response = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 8}})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert "content-length" in response.headers  # one body, not chunked
    assert "transfer-encoding" not in response.headers
    raw = response.text
    assert not raw.endswith("\n")
    body = json.loads(raw)
    assert list(body) == ["generated_text"]
    assert raw == '{"generated_text": ' + json.dumps(body["generated_text"], ensure_ascii=False) + "}"
    assert isinstance(body["generated_text"], str) and body["generated_text"]


def test_json_details_shape_and_key_order(server):
    response = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}})
    assert response.status_code == 200, response.text
    raw = response.text
    assert is_lmi_json(raw)
    assert raw.startswith('{"generated_text": ')
    body = json.loads(raw)
    assert list(body) == ["generated_text", "details"]
    details = body["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "inputs", "tokens"]
    assert details["finish_reason"] in ("length", "eos_token")
    assert details["generated_tokens"] == len(details["tokens"]) <= 6
    assert details["inputs"] == PROMPT
    for token in details["tokens"]:
        assert list(token)[:3] == ["id", "text", "log_prob"]
        assert set(token) <= {"id", "text", "log_prob", "special_token"}
        assert isinstance(token["id"], int) and isinstance(token["log_prob"], float)
        assert token["log_prob"] <= 0.0
        if "special_token" in token:
            assert token["special_token"] is True
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]


def test_details_false_has_no_details_key(server):
    body = server.generate(PROMPT, max_new_tokens=3, details=False)
    assert list(body) == ["generated_text"]


def test_decoder_input_details_and_top_tokens(server, tiny_model):
    response = server.post(
        {
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": 5, "details": True, "decoder_input_details": True, "top_n_tokens": 3},
        }
    )
    assert response.status_code == 200, response.text
    assert is_lmi_json(response.text)
    details = response.json()["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "inputs", "tokens", "prefill", "top_tokens"]

    prompt_ids = tiny_model.tokenizer(PROMPT)["input_ids"]
    prefill = details["prefill"]
    assert [t["id"] for t in prefill] == prompt_ids  # one entry per prompt token, BOS first
    assert prefill[0]["log_prob"] is None
    assert '"log_prob": null' in response.text
    assert all(isinstance(t["log_prob"], float) for t in prefill[1:])
    assert prefill[0]["id"] == tiny_model.tokenizer.bos_token_id
    assert prefill[0].get("special_token") is True

    top = details["top_tokens"]
    assert len(top) == details["generated_tokens"] == len(details["tokens"])
    for step, token in zip(top, details["tokens"]):
        assert len(step) == 3
        assert [t["log_prob"] for t in step] == sorted((t["log_prob"] for t in step), reverse=True)
        assert step[0]["id"] == token["id"]  # greedy picks the most likely token
        assert step[0]["log_prob"] == pytest.approx(token["log_prob"])


def test_return_full_text_prepends_prompt(server):
    plain = server.generate(PROMPT, max_new_tokens=5)["generated_text"]
    full = server.generate(PROMPT, max_new_tokens=5, return_full_text=True)["generated_text"]
    assert full == PROMPT + plain


def test_non_ascii_is_raw_utf8(server):
    response = server.post({"inputs": NON_ASCII_SAMPLE, "parameters": {"max_new_tokens": 3, "details": True}})
    assert response.status_code == 200, response.text
    assert NON_ASCII_SAMPLE.encode("utf-8") in response.content  # ensure_ascii=False
    assert is_lmi_json(response.text)
    assert response.json()["details"]["inputs"] == NON_ASCII_SAMPLE


def test_unknown_output_formatter_falls_back_to_the_default_rule(server):
    response = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "output_formatter": "bogus"}})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert list(response.json()) == ["generated_text"]


def test_json_formatter_with_stream_true_gives_one_body(server):
    response = server.post(
        {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4, "output_formatter": "json"}}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert list(response.json()) == ["generated_text"]


# --- jsonlines (stream: true) -------------------------------------------------------------------------


def test_jsonlines_stream(server):
    response, lines = server.stream(PROMPT, max_new_tokens=7)
    assert response.headers.get("transfer-encoding") == "chunked"
    assert 1 <= len(lines) <= 7
    for line in lines[:-1]:
        assert list(line) == ["token"]
        assert list(line["token"])[:3] == ["id", "text", "log_prob"]
    last = lines[-1]
    assert list(last) == ["token", "generated_text"]  # no details unless asked
    assert token_texts(lines) == last["generated_text"]
    # the same tokens as the non-streaming answer
    assert last["generated_text"] == server.generate(PROMPT, max_new_tokens=7)["generated_text"]


def test_jsonlines_stream_with_details(server):
    _, lines = server.stream(PROMPT, max_new_tokens=5, details=True, ignore_eos_token=True)
    assert len(lines) == 5
    last = lines[-1]
    assert list(last) == ["token", "generated_text", "details"]
    assert list(last["details"]) == ["finish_reason", "generated_tokens", "inputs"]  # no tokens list
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 5, "inputs": PROMPT}
    assert all("details" not in line and "generated_text" not in line for line in lines[:-1])
    assert token_texts(lines) == last["generated_text"]


def test_jsonlines_stream_with_prefill_and_top_tokens(server, tiny_model):
    _, lines = server.stream(
        PROMPT, max_new_tokens=4, details=True, decoder_input_details=True, top_n_tokens=2, ignore_eos_token=True
    )
    details = lines[-1]["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "inputs", "prefill", "top_tokens"]
    assert [t["id"] for t in details["prefill"]] == tiny_model.tokenizer(PROMPT)["input_ids"]
    assert details["prefill"][0]["log_prob"] is None
    assert len(details["top_tokens"]) == 4 and all(len(step) == 2 for step in details["top_tokens"])


def test_jsonlines_return_full_text_changes_only_generated_text(server):
    _, lines = server.stream(PROMPT, max_new_tokens=4, return_full_text=True)
    assert lines[-1]["generated_text"] == PROMPT + token_texts(lines)


def test_stream_is_a_top_level_field(server):
    # parameters.stream is overwritten by the top-level value (default false)
    response = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "stream": True}})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    response = server.post({"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3, "stream": False}})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/jsonlines"


# --- sse ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "formatter-only"])
def test_sse_per_request_formatter(server, stream):
    payload = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "output_formatter": "sse", "details": True}}
    if stream:
        payload["stream"] = True
    response = server.post(payload)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream"
    assert "[DONE]" not in response.text
    events = server.sse(response.text)
    assert 1 <= len(events) <= 6
    assert all(list(e) == ["token"] for e in events[:-1])
    last = events[-1]
    assert list(last) == ["token", "generated_text", "details"]
    assert list(last["token"])[:3] == ["id", "text", "log_prob"]  # LMI keys, not TGI's
    assert token_texts(events) == last["generated_text"]
    assert last["details"]["generated_tokens"] == len(events)


# --- max_new_tokens ---------------------------------------------------------------------------------------


def test_default_max_new_tokens_is_30(server):
    body = server.generate(PROMPT, details=True, ignore_eos_token=True)
    assert body["details"]["generated_tokens"] == 30
    assert body["details"]["finish_reason"] == "length"
    _, lines = server.stream(PROMPT, ignore_eos_token=True)
    assert len(lines) == 30


@pytest.mark.parametrize("n", [1, 2, 17])
def test_max_new_tokens_is_respected(server, n):
    body = server.generate(PROMPT, max_new_tokens=n, details=True, ignore_eos_token=True)
    assert body["details"]["generated_tokens"] == len(body["details"]["tokens"]) == n
    _, lines = server.stream(PROMPT, max_new_tokens=n, ignore_eos_token=True)
    assert len(lines) == n
    assert lines[-1]["generated_text"] == body["generated_text"]


# --- stop sequences --------------------------------------------------------------------------------------


def _pick_stop(tokens: list[dict]) -> str:
    """A clean stop string made of generated token texts from the 3rd token on."""
    texts = [t["text"] for t in tokens]
    for start in range(2, len(texts) - 2):
        for length in (1, 2, 3):
            candidate = "".join(texts[start : start + length])
            if len(candidate) >= 2 and candidate.strip() and candidate.isprintable() and "\ufffd" not in candidate:
                return candidate
    raise AssertionError(f"no usable stop string in {texts}")


@pytest.fixture(scope="module")
def stop_case(server):
    body = server.generate(PROMPT, max_new_tokens=20, details=True, ignore_eos_token=True)
    full = body["generated_text"]
    stop = _pick_stop(body["details"]["tokens"])
    index = full.find(stop)
    assert index >= 0
    return full, stop, index


def test_stop_sequence(server, stop_case):
    full, stop, index = stop_case
    body = server.generate(PROMPT, max_new_tokens=20, details=True, ignore_eos_token=True, stop_sequences=[stop])
    assert body["generated_text"] == full[:index]
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["details"]["generated_tokens"] < 20
    assert "".join(t["text"] for t in body["details"]["tokens"]) == body["generated_text"]


def test_stop_sequence_included_on_request(server, stop_case):
    full, stop, index = stop_case
    body = server.generate(
        PROMPT,
        max_new_tokens=20,
        details=True,
        ignore_eos_token=True,
        stop_sequences=[stop],
        include_stop_str_in_output=True,
    )
    assert body["generated_text"] == full[: index + len(stop)]
    assert body["details"]["finish_reason"] == "stop_sequence"


def test_stop_tgi_spelling(server, stop_case):
    full, stop, index = stop_case
    body = server.generate(PROMPT, max_new_tokens=20, ignore_eos_token=True, stop=[stop])
    assert body["generated_text"] == full[:index]


@pytest.mark.parametrize("include", [False, True])
def test_stop_sequence_streaming(server, stop_case, include):
    full, stop, index = stop_case
    _, lines = server.stream(
        PROMPT,
        max_new_tokens=20,
        details=True,
        ignore_eos_token=True,
        stop_sequences=[stop],
        include_stop_str_in_output=include,
    )
    last = lines[-1]
    expected = full[: index + len(stop)] if include else full[:index]
    assert last["generated_text"] == expected
    assert token_texts(lines) == expected
    assert last["details"]["finish_reason"] == "stop_sequence"
    assert last["details"]["generated_tokens"] == len(lines)


def test_stop_sequence_never_matching(server, stop_case):
    full, _, _ = stop_case
    body = server.generate(
        PROMPT, max_new_tokens=20, details=True, ignore_eos_token=True, stop_sequences=["\u2603\u2603"]
    )
    assert body["generated_text"] == full
    assert body["details"]["finish_reason"] == "length"


# --- seeds and greedy determinism --------------------------------------------------------------------------


def test_same_seed_same_sample(server):
    a = server.generate(PROMPT, max_new_tokens=20, do_sample=True, seed=7, details=True, ignore_eos_token=True)
    b = server.generate(PROMPT, max_new_tokens=20, do_sample=True, seed=7, details=True, ignore_eos_token=True)
    assert ids_of(a) == ids_of(b)
    assert a["generated_text"] == b["generated_text"]


def test_different_seeds_differ(server):
    a = server.generate(PROMPT, max_new_tokens=20, do_sample=True, seed=7, details=True, ignore_eos_token=True)
    b = server.generate(PROMPT, max_new_tokens=20, do_sample=True, seed=8, details=True, ignore_eos_token=True)
    assert ids_of(a) != ids_of(b)


def test_unseeded_samples_differ(server):
    """a random seed per request, not seed 0 for everyone."""
    a = server.generate(PROMPT, max_new_tokens=20, do_sample=True, details=True, ignore_eos_token=True)
    b = server.generate(PROMPT, max_new_tokens=20, do_sample=True, details=True, ignore_eos_token=True)
    assert ids_of(a) != ids_of(b)


def test_temperature_alone_means_sampling(server):
    """greedy unless do_sample or temperature is given."""
    sampled = server.generate(PROMPT, max_new_tokens=12, do_sample=True, seed=7, details=True, ignore_eos_token=True)
    by_temperature = server.generate(
        PROMPT, max_new_tokens=12, temperature=1.0, seed=7, details=True, ignore_eos_token=True
    )
    greedy = server.generate(PROMPT, max_new_tokens=12, details=True, ignore_eos_token=True)
    assert ids_of(by_temperature) == ids_of(sampled)
    assert ids_of(sampled) != ids_of(greedy)
    forced_greedy = server.generate(
        PROMPT, max_new_tokens=12, do_sample=False, temperature=1.0, seed=7, details=True, ignore_eos_token=True
    )
    assert ids_of(forced_greedy) == ids_of(greedy)


def test_greedy_twice_identical(server):
    a = server.generate(PROMPT, max_new_tokens=15, details=True)
    b = server.generate(PROMPT, max_new_tokens=15, details=True)
    assert ids_of(a) == ids_of(b)
    assert a == b


@pytest.fixture(scope="module")
def hf_reference(tiny_model):
    return {prompt: hf_greedy(tiny_model, prompt, 20) for prompt in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_model_generate(server, tiny_model, hf_reference, prompt):
    body = server.generate(prompt, max_new_tokens=20, details=True)
    assert ids_of(body) == hf_reference[prompt]
    assert body["generated_text"] == tiny_model.tokenizer.decode(hf_reference[prompt], skip_special_tokens=True)


def test_greedy_equals_model_generate_under_concurrency(server, hf_reference):
    """6 concurrent greedy requests (each prompt twice, streaming and not) plus two seeded samples:
    batching changes nothing."""
    seeded = server.generate(PROMPT, max_new_tokens=20, do_sample=True, seed=11, details=True, ignore_eos_token=True)
    jobs = [(p, stream) for p in PROMPTS for stream in (False, True)]

    def run(job):
        prompt, stream = job
        if stream:
            _, lines = server.stream(prompt, max_new_tokens=20)
            return [line["token"]["id"] for line in lines]
        return ids_of(server.generate(prompt, max_new_tokens=20, details=True))

    def sample(_):
        return ids_of(
            server.generate(PROMPT, max_new_tokens=20, do_sample=True, seed=11, details=True, ignore_eos_token=True)
        )

    with ThreadPoolExecutor(max_workers=8) as pool:
        sampled = [pool.submit(sample, i) for i in range(2)]
        results = list(pool.map(run, jobs))
        sampled = [f.result(timeout=60) for f in sampled]
    for (prompt, stream), ids in zip(jobs, results):
        assert ids == hf_reference[prompt], (prompt, stream)
    assert sampled == [ids_of(seeded)] * 2


# --- other routes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/predictions/{name}", "/predictions/{name}/1", "/models/{name}/invoke", "/invocations?model_name={name}"]
)
def test_inference_routes_behave_like_invocations(server, path):
    expected = server.generate(PROMPT, max_new_tokens=5)
    response = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}, path=path.format(name=server.name))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == expected


def test_model_name_header_selects_the_model(server):
    response = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}, headers={"model_name": server.name})
    assert response.status_code == 200, response.text


# --- best_of / n ----------------------------------------------------------------------


def test_best_of_shape(server):
    response = server.post(
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "do_sample": True, "seed": 3, "best_of": 3}}
    )
    assert response.status_code == 200, response.text
    assert is_lmi_json(response.text)
    body = response.json()
    assert list(body) == ["generated_text", "details"]  # details even without "details": true
    details = body["details"]
    assert list(details) == ["inputs", "finish_reason", "generated_tokens", "tokens", "best_of_sequences"]
    assert details["inputs"] == PROMPT
    assert len(details["best_of_sequences"]) == 2  # best_of without n -> n = best_of
    for other in details["best_of_sequences"]:
        assert list(other) == ["finish_reason", "generated_tokens", "tokens", "generated_text"]
        assert "".join(t["text"] for t in other["tokens"]) == other["generated_text"]
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]


def test_n_two_of_best_of_three(server):
    body = server.generate(PROMPT, max_new_tokens=4, do_sample=True, seed=3, best_of=3, n=2)
    assert len(body["details"]["best_of_sequences"]) == 1


def test_per_request_tgi_compat_formatter(server):
    """lmiserve extension (protocols/lmi/formatters/base.py): output_formatter "tgi_compat" selects TGI output per request."""
    response = server.post({"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "output_formatter": "tgi_compat"}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body, list) and list(body[0]) == ["generated_text", "details"]
    assert "logprob" in body[0]["details"]["tokens"][0]
    response = server.post(
        {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3, "output_formatter": "tgi_compat"}}
    )
    assert response.headers["content-type"] == "text/event-stream"
    assert "logprob" in server.sse(response.text)[0]["token"]
