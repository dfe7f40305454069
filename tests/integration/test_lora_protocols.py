"""Every text protocol picks the LoRA adapter a request names, on a real server (`lora_server`: the tiny
model with the adapters ``alpha``, ``beta`` and ``gamma``), driven by the protocols' own clients where
they exist (openai, anthropic, huggingface_hub's InferenceClient for TGI). Greedy outputs are checked
against PEFT's (`helpers.lora_adapters.merged_generate`: the base model with the adapter merged), so a
protocol that dropped the adapter, or passed the wrong one, fails; an unknown adapter is each protocol's
404, body for body. How each protocol names it: docs/lora.md, "Choosing an adapter per request"."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import UnknownError
from text_generation import Client

from helpers.lora_adapters import merged_generate

PROMPT = "Deep learning is"
N = 8  # new tokens
ADAPTERS = ("alpha", "beta", "gamma")
SAGEMAKER = "X-Amzn-SageMaker-Adapter-Identifier"
MESSAGES = [{"role": "user", "content": "Tell me about deep learning"}]


def compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return list(tokenizer(PROMPT)["input_ids"])  # as the engine encodes the text (special tokens added)


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, lora_adapter_dirs: dict[str, Path], prompt_ids: list[int]) -> dict:
    """PEFT's greedy tokens for `PROMPT`, by adapter (None: the base model)."""
    out = {name: merged_generate(tiny_model_dir, lora_adapter_dirs[name], [prompt_ids], N)[0] for name in ADAPTERS}
    out[None] = merged_generate(tiny_model_dir, None, [prompt_ids], N)[0]
    assert len({tuple(ids) for ids in out.values()}) == 4, "every adapter should change the tiny model's answer"
    return out


@pytest.fixture(scope="module")
def text(expected: dict, tokenizer) -> dict:
    return {name: tokenizer.decode(ids, skip_special_tokens=True) for name, ids in expected.items()}


# --- TGI --------------------------------------------------------------------------------------------------


def _tgi(lora_server, path: str, adapter_id, **parameters) -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"adapter_id": adapter_id, "max_new_tokens": N, **parameters}}
    return lora_server.client.post(path, json=body)


@pytest.mark.parametrize("adapter_id", [*ADAPTERS, None, "", "tiny"])
def test_tgi_generate_matches_the_merged_adapter(lora_server, expected, prompt_ids, adapter_id):
    r = _tgi(lora_server, "/generate", adapter_id, details=True, decoder_input_details=True)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    assert [t["id"] for t in details["prefill"]] == prompt_ids
    base = adapter_id in (None, "", "tiny")  # no adapter, or the served model's own name
    assert [t["id"] for t in details["tokens"]] == expected[None if base else adapter_id]


def test_tgi_stream_and_compat_route(lora_server, expected):
    r = _tgi(lora_server, "/generate_stream", "beta")
    events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e]
    assert [e["token"]["id"] for e in events] == expected["beta"]
    r = _tgi(lora_server, "/", "gamma", details=True)
    assert [t["id"] for t in r.json()[0]["details"]["tokens"]] == expected["gamma"]


def test_tgi_clients(lora_server, expected, text):
    hub = InferenceClient(lora_server.url, timeout=30)
    answer = hub.text_generation(PROMPT, adapter_id="alpha", max_new_tokens=N, details=True)
    assert [t.id for t in answer.details.tokens] == expected["alpha"]
    streamed = hub.text_generation(PROMPT, adapter_id="gamma", max_new_tokens=N, stream=True, details=True)
    assert [e.token.id for e in streamed] == expected["gamma"]
    client = Client(lora_server.url, timeout=30)  # text-generation 0.7 has no adapter_id: the base model
    assert [t.id for t in client.generate(PROMPT, max_new_tokens=N).details.tokens] == expected[None]


def test_tgi_unknown_adapter_is_404_not_found(lora_server):
    body = b'{"error":"`adapter_id` names adapter `delta`, which is not served","error_type":"not_found"}'
    for path in ("/generate", "/generate_stream", "/"):
        r = _tgi(lora_server, path, "delta")
        assert (r.status_code, r.headers["content-type"], r.content) == (404, "application/json", body), path
    # the hub client's TGI errors know no `not_found` type: its UnknownError, with the server's message
    with pytest.raises(UnknownError, match="^`adapter_id` names adapter `delta`, which is not served$"):
        InferenceClient(lora_server.url, timeout=30).text_generation(PROMPT, adapter_id="delta", max_new_tokens=N)


# --- OpenAI ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oai(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none", timeout=30, max_retries=0)


def test_openai_completions_model_names_the_adapter(oai, prompt_ids, text):
    for name in ADAPTERS:
        completion = oai.completions.create(model=name, prompt=prompt_ids, max_tokens=N, temperature=0)
        assert (completion.model, completion.choices[0].text) == (name, text[name])
    completion = oai.completions.create(model="tiny", prompt=prompt_ids, max_tokens=N, temperature=0)
    assert (completion.model, completion.choices[0].text) == ("tiny", text[None])


def test_openai_completions_stream(oai, prompt_ids, text):
    stream = oai.completions.create(model="gamma", prompt=prompt_ids, max_tokens=N, temperature=0, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"gamma"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text["gamma"]


def _chat(oai: openai.OpenAI, model: str, **kwargs) -> str:
    answer = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0, **kwargs)
    if kwargs.get("stream"):
        chunks = list(answer)
        assert {c.model for c in chunks} == {model}
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert answer.model == model
    return answer.choices[0].message.content or ""


def test_openai_chat_model_names_the_adapter(oai):
    beta = _chat(oai, "beta")
    assert beta == _chat(oai, "beta", stream=True)  # deterministic, streamed or not
    assert beta != _chat(oai, "tiny")
    assert len({beta, _chat(oai, "alpha"), _chat(oai, "gamma")}) == 3
    response = oai.responses.create(model="beta", input=MESSAGES, max_output_tokens=N, temperature=0)
    assert (response.model, response.output_text) == ("beta", beta)  # the same prompt on another route


def test_openai_unknown_model_is_404(oai, lora_server):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="delta", messages=MESSAGES, max_tokens=N)
    assert info.value.code == "model_not_found"
    error = {"message": "The model `delta` does not exist.", "type": "not_found_error", "param": "model"}
    for route, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        for stream in (False, True):
            r = lora_server.client.post(route, json={**body, "model": "delta", "stream": stream})
            assert (r.status_code, r.content) == (404, compact({"error": {**error, "code": "model_not_found"}}))


def test_tokenize_an_adapter(lora_server, prompt_ids):
    r = lora_server.client.post("/tokenize", json={"model": "alpha", "prompt": PROMPT})
    assert (r.status_code, r.json()["tokens"]) == (200, prompt_ids)


# --- Anthropic ---------------------------------------------------------------------------------------------


def test_anthropic_messages_model_names_the_adapter(lora_server, oai):
    client = anthropic.Anthropic(base_url=lora_server.url, api_key="none", timeout=30, max_retries=0)
    greedy = {"temperature": 0}  # this client has no `temperature` argument; unset, Anthropic samples
    message = client.messages.create(model="gamma", max_tokens=N, messages=MESSAGES, extra_body=greedy)
    assert message.model == "gamma"
    assert message.content[0].text == _chat(oai, "gamma")  # the same prompt through OpenAI's route
    with client.messages.stream(model="gamma", max_tokens=N, messages=MESSAGES, extra_body=greedy) as stream:
        assert "".join(stream.text_stream) == message.content[0].text
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="delta", max_tokens=N, messages=MESSAGES)
    r = lora_server.client.post("/v1/messages", json={"model": "delta", "max_tokens": N, "messages": MESSAGES})
    assert (r.status_code, r.content) == (
        404,
        b'{"type":"error","error":{"type":"not_found_error","message":"model: delta"}}',
    )


# --- LMI ---------------------------------------------------------------------------------------------------


def _lmi_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_lmi_adapters_query_and_sagemaker_header(lora_server, expected):
    params = {"max_new_tokens": N, "details": True}
    post = lora_server.post
    assert _lmi_ids(post({"inputs": PROMPT, "adapters": "alpha", "parameters": params})) == expected["alpha"]
    assert _lmi_ids(post({"inputs": PROMPT, "adapters": ["beta"], "parameters": params})) == expected["beta"]
    body = {"inputs": PROMPT, "parameters": {**params, "adapter_id": "gamma"}}
    assert _lmi_ids(post(body)) == expected["gamma"]
    assert _lmi_ids(post({"inputs": PROMPT, "parameters": params}, params={"adapter": "beta"})) == expected["beta"]
    assert _lmi_ids(post({"inputs": PROMPT, "parameters": params}, headers={SAGEMAKER: "alpha"})) == expected["alpha"]
    body = {"inputs": PROMPT, "adapters": "tiny", "parameters": params}  # the base model, named
    assert _lmi_ids(post(body, headers={SAGEMAKER: "alpha"})) == expected[None]
    r = post({"inputs": PROMPT, "parameters": params}, path="/predictions/tiny", params={"adapter": "gamma"})
    assert _lmi_ids(r) == expected["gamma"]
    r = post({"inputs": PROMPT, "adapters": "beta", "stream": True, "parameters": {"max_new_tokens": N}})
    assert [line["token"]["id"] for line in lora_server.jsonlines(r.text)] == expected["beta"]


def test_lmi_unknown_adapter_is_404(lora_server):
    for body, query, headers, field in (
        ({"adapters": "delta"}, None, None, "adapters"),
        ({"parameters": {"adapter_id": "delta"}}, None, None, "adapter_id"),
        ({}, {"adapter": "delta"}, None, "adapter"),
        ({"stream": True}, None, {SAGEMAKER: "delta"}, SAGEMAKER),
    ):
        r = lora_server.post({"inputs": PROMPT, **body}, params=query, headers=headers)
        assert (r.status_code, r.headers["content-type"]) == (404, "application/json")
        assert r.content == compact({"error": f"`{field}` names adapter `delta`, which is not served", "code": 404})


def test_lmi_dynamic_batch_one_adapter_per_input(lora_dynamic_server, tiny_model_dir, lora_adapter_dirs, tokenizer):
    prompts = [PROMPT, "Hello there"]
    ids = [list(tokenizer(p)["input_ids"]) for p in prompts]
    alpha = merged_generate(tiny_model_dir, lora_adapter_dirs["alpha"], ids[:1], N)[0]
    gamma = merged_generate(tiny_model_dir, lora_adapter_dirs["gamma"], ids[1:], N)[0]
    params = {"max_new_tokens": N, "return_full_text": False}
    r = lora_dynamic_server.post({"inputs": prompts, "adapters": ["alpha", "gamma"], "parameters": params})
    assert r.status_code == 200, r.text
    texts = [answer["generated_text"] for answer in r.json()]
    assert texts == [
        tokenizer.decode(alpha, skip_special_tokens=True),
        tokenizer.decode(gamma, skip_special_tokens=True),
    ]
    r = lora_dynamic_server.post({"inputs": prompts, "adapters": ["alpha"], "parameters": params})
    assert r.status_code == 424 and "Number of adapters is not equal to the number of inputs" in r.json()["error"]


# --- tensor protocols --------------------------------------------------------------------------------------


def test_kserve_infer_and_generate_adapter_id(lora_server, text):
    body = {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}],
        "parameters": {"max_new_tokens": N, "adapter_id": "alpha"},
    }
    r = lora_server.client.post("/v2/models/tiny/infer", json=body)
    assert (r.status_code, r.json()["outputs"][0]["data"]) == (200, [text["alpha"]])
    r = lora_server.client.post(
        "/v2/models/tiny/generate", json={"text_input": PROMPT, "parameters": {"max_tokens": N, "lora_name": "beta"}}
    )
    assert (r.status_code, r.json()["text_output"]) == (200, text["beta"])
    r = lora_server.client.post("/v2/models/tiny/infer", json={**body, "parameters": {"adapter_id": "delta"}})
    assert (r.status_code, r.content) == (404, b'{"error": "`adapter_id` names adapter `delta`, which is not served"}')
