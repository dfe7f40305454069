"""The tensor protocols on an LLM over HTTP, in process, on the scripted fake engine
(tests/helpers/text_app.py) wired as the real engine is (`ModelService.attach_llm` gives it its
`LlmTensorModel`): KServe V2 generate / generate_stream and infer, the V2 input checks and metadata of
the LLM, SageMaker's JSON Lines and CSV records, and Vertex AI predict. The events-level behaviour of V2
generate (in-band errors, other sequences) is in test_v2_generate_http.py.

The same requests on a real server: tests/integration/test_v2_generate.py, test_v2_input_checks.py,
test_sagemaker_tensors.py, test_vertex.py."""

from __future__ import annotations

import json

import pytest

from helpers.tensor_app import affine_model
from helpers.text_app import Script, text_app

FOX = " the quick brown fox jumps"
ATTR = "X-Amzn-SageMaker-Custom-Attributes"


@pytest.fixture
def served():
    served = text_app(others={"affine": affine_model()})
    served.fake.reply(Script(text=FOX))
    return served


async def lmi_text(http, prompt: str, **parameters) -> str:
    r = await http.post("/invocations", json={"inputs": prompt, "parameters": parameters})
    assert r.status_code == 200, r.text
    return r.json()["generated_text"]


# --- KServe V2 generate -----------------------------------------------------------------------------------


async def test_generate_matches_lmi(served):
    async with served.client() as http:
        expected = await lmi_text(http, "Once upon a time", max_new_tokens=3)
        body = {"id": "42", "text_input": "Once upon a time", "parameters": {"max_new_tokens": 3, "stream": False}}
        r = await http.post("/v2/models/tiny/generate", json=body)
        assert (r.status_code, r.headers["content-type"]) == (200, "application/json")
        assert (
            r.content == b'{"id": "42", "model_name": "tiny", "model_version": "1", "text_output": " the quick brown"}'
        )
        assert expected == " the quick brown"
        # extra top-level keys are parameters too
        r = await http.post(
            "/v2/models/tiny/versions/1/generate", json={"text_input": "Once upon a time", "max_new_tokens": 3}
        )
        assert r.json() == {"model_name": "tiny", "model_version": "1", "text_output": expected}
        r = await http.post(
            "/v2/models/tiny/generate", json={"text_input": "Hi", "max_new_tokens": 2, "return_full_text": True}
        )
        assert r.json()["text_output"] == "Hi the quick"
    assert [r.params.max_new_tokens for r in served.fake.requests] == [3, 3, 3, 2]


async def test_generate_stream_is_sse_whose_pieces_make_the_text(served):
    async with served.client() as http:
        body = {"id": "s1", "text_input": "Once upon a time", "parameters": {"max_new_tokens": 8}}
        r = await http.post("/v2/models/tiny/generate_stream", json=body)
    assert r.status_code == 200
    assert (r.headers["content-type"], r.headers["cache-control"]) == ("text/event-stream; charset=utf-8", "no-cache")
    pieces = [" the", " quick", " brown", " fox", " jumps"]  # then EOS, which sends nothing
    assert r.content == b"".join(
        b"data: "
        + json.dumps({"id": "s1", "model_name": "tiny", "model_version": "1", "text_output": p}).encode()
        + b"\n\n"
        for p in pieces
    )


async def test_generate_errors(served):
    async with served.client() as http:
        r = await http.post("/v2/models/tiny/generate", json={"text_input": ""})
        assert (r.status_code, r.content) == (400, b'{"error": "\'text_input\' must be a non-empty string"}')
        r = await http.post(
            "/v2/models/tiny/generate_stream", json={"text_input": "x", "parameters": {"temperature": -1}}
        )
        assert r.status_code == 400
        assert r.json() == {
            "error": "Invalid value -1 for parameter 'temperature': Input should be greater than or equal to 0"
        }
        r = await http.post("/v2/models/nope/generate", json={"text_input": "x"})
        assert (r.status_code, r.content) == (404, b'{"error": "Model nope not found"}')
        r = await http.post("/v2/models/tiny/generate", json={"text_input": "word " * 300})
        assert r.json() == {"error": "Input prompt (603 tokens) is too long and exceeds limit of 256"}
    assert len(served.fake.requests) == 1  # the prompt too long for the model was refused by the engine


async def test_generate_takes_the_triton_backends_spellings(served):
    """TensorRT-LLM's and vLLM's names for the parameters /generate honours reach the engine as LMI's."""
    triton = {
        "max_tokens": 3,
        "random_seed": 7,
        "temperature": 0.5,
        "top_k": 4,
        "top_p": 0.9,
        "stop_words": ["fox"],
        "ignore_eos": True,
        "min_length": 2,
        "exclude_input_in_output": False,
        "beam_width": 1,
        "bad_words": [],
        "return_log_probs": False,
        "stream": False,
    }
    async with served.client() as http:
        r = await http.post("/v2/models/tiny/generate", json={"text_input": "Once upon a time", "parameters": triton})
        assert r.json() == {
            "model_name": "tiny",
            "model_version": "1",
            "text_output": "Once upon a time the quick brown",
        }
        vllm = {"max_tokens": 2, "seed": 7, "min_tokens": 1, "exclude_input_in_output": True}
        r = await http.post("/v2/models/tiny/generate_stream", json={"text_input": "Hi", **vllm})
        assert r.status_code == 200 and b"Hi" not in r.content
    first, second = (req.params for req in served.fake.requests)
    assert (first.max_new_tokens, first.seed, first.temperature, first.top_k, first.top_p) == (3, 7, 0.5, 4, 0.9)
    assert (first.stop_sequences, first.ignore_eos_token, first.min_new_tokens) == (["fox"], True, 2)
    assert (second.max_new_tokens, second.seed, second.min_new_tokens) == (2, 7, 1)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"bad_words": ["fox"]},
            "parameter 'bad_words' is not supported: bad-word filtering is not supported (no token is banned)",
        ),
        (
            {"end_id": 2},
            "parameter 'end_id' is not supported: a custom end token is not supported; use 'stop_token_ids'",
        ),
        (
            {"beam_width": 2},
            "parameter 'beam_width' is not supported: beam search is not supported (beam_width 1 only)",
        ),
        (
            {"length_penalty": 0.5},
            "parameter 'length_penalty' is not supported: length_penalty applies to beam search, which is not supported",
        ),
        ({"n": 2, "temperature": 1}, "parameter 'n' is not supported: /generate answers one sequence (n 1 only)"),
        ({"return_log_probs": True}, "'return_log_probs' is not supported: /generate answers text_output only"),
        (
            {"return_generation_logits": True},
            "'return_generation_logits' is not supported: /generate answers text_output only",
        ),
        ({"details": True}, "'details' is not supported: /generate answers text_output only"),
        ({"return_log_probs": "yes"}, "'return_log_probs' must be a boolean"),
        ({"exclude_input_in_output": 1}, "'exclude_input_in_output' must be a boolean"),
        ({"max_tokens": 3, "max_new_tokens": 4}, "'max_tokens' and 'max_new_tokens' disagree; give one of them"),
        (
            {"exclude_input_in_output": True, "return_full_text": True},
            "'exclude_input_in_output' and 'return_full_text' disagree; give one of them",
        ),
        ({"maxtokens": 3}, "unknown parameter: maxtokens"),
        (
            {"pad_id": 0, "watermark": True, "foo": 1},
            "parameter 'pad_id' is not supported: a custom padding token is not supported",
        ),
        ({"watermark": True, "foo": 1}, "unknown parameters: foo, watermark"),
        (
            {"max_tokens": 0},
            "Invalid value 0 for parameter 'max_new_tokens': Input should be greater than or equal to 1",
        ),
    ],
)
async def test_generate_refuses_what_it_cannot_honour(served, parameters, message):
    async with served.client() as http:
        for route in ("generate", "generate_stream"):
            r = await http.post(f"/v2/models/tiny/{route}", json={"text_input": "Hi", "parameters": parameters})
            assert (r.status_code, r.json()) == (400, {"error": message}), route
            r = await http.post(f"/v2/models/tiny/{route}", json={"text_input": "Hi", **parameters})  # top level
            assert (r.status_code, r.json()) == (400, {"error": message}), route
    assert served.fake.requests == []


async def test_generate_on_a_model_that_is_not_ready():
    served = text_app(status="PENDING")
    async with served.client() as http:
        for route in ("generate", "generate_stream"):
            r = await http.post(f"/v2/models/tiny/{route}", json={"text_input": "x"})
            assert (r.status_code, r.content) == (503, b'{"error": "Model tiny is not ready yet."}')
        r = await http.get("/v2/health/ready")
        assert (r.status_code, r.content) == (503, b'{"error": "Server is not ready.", "ready": false}')
        r = await http.get("/v2/models/tiny/ready")
        assert (r.status_code, r.content) == (503, b'{"error": "Model tiny is not ready yet.", "ready": false}')


# --- KServe V2 infer, health and metadata on the LLM ----------------------------------------------------------------


async def test_v2_health_metadata_and_infer_on_the_llm(served):
    async with served.client() as http:
        assert (await http.get("/v2/health/live")).content == b'{"live": true}'
        assert (await http.get("/v2/health/ready")).content == b'{"ready": true}'
        assert (await http.get("/v2/models/tiny/ready")).content == b'{"name": "tiny", "ready": true}'
        meta = (await http.get("/v2/models/tiny")).json()
        assert meta["platform"] == "lmiserve_llm"
        assert meta["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}]
        body = {
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["Hello", "Hi"]}],
            "parameters": {"max_new_tokens": 3},
        }
        r = await http.post("/v2/models/tiny/infer", json=body)
        expected = await lmi_text(http, "Hello", max_new_tokens=3)
    out = r.json()["outputs"][0]
    assert (out["name"], out["datatype"], out["shape"], out["data"]) == ("text_output", "BYTES", [2], [expected] * 2)
    assert [req.prompt for req in served.fake.requests[:2]] == ["Hello", "Hi"]


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["Hello"]}],
            "unexpected inference input 'prompt' for model 'tiny'",
        ),
        ([], "the inference request needs a non-empty 'inputs' list"),
        (
            [{"name": "text_input", "datatype": "FP32", "shape": [1], "data": [1.0]}],
            "inference input 'text_input' data-type is 'FP32', but model 'tiny' expects 'BYTES'",
        ),
        (
            [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [""]}],
            "input 'text_input' holds an empty prompt",
        ),
    ],
    ids=["undeclared", "none", "datatype", "empty-prompt"],
)
async def test_the_llm_takes_only_text_input(served, inputs, message):
    async with served.client() as http:
        r = await http.post("/v2/models/tiny/infer", json={"inputs": inputs})
    assert (r.status_code, r.json()) == (400, {"error": message})
    assert served.fake.requests == []


# --- SageMaker on the LLM ------------------------------------------------------------------------------------------


async def test_sagemaker_json_body_keeps_lmi_semantics(served):
    async with served.client() as http:
        r = await http.post("/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    assert (r.status_code, r.content) == (200, b'{"generated_text": " the quick brown fox"}')


async def test_sagemaker_json_lines_batch(served):
    served.fake.reply_once(Script(text=" the"), Script(text=FOX))
    lines = [
        {"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
        {"inputs": "The sky is", "parameters": {"max_new_tokens": 3}},
    ]
    body = "\n".join(json.dumps(line) for line in lines) + "\n"
    async with served.client() as http:
        r = await http.post(
            "/invocations", content=body.encode(), headers={"content-type": "application/jsonlines", ATTR: "trace=abc"}
        )
        assert r.status_code == 200, r.text
        assert (r.headers["content-type"], r.headers[ATTR]) == ("application/jsonlines", "trace=abc")
        assert r.content == b'{"generated_text": " the"}\n{"generated_text": " the quick brown"}\n'
        served.fake.reply_once(Script(text=" the"), Script(text=FOX))
        r = await http.post(
            "/invocations",
            content=body.encode(),
            headers={"content-type": "application/jsonlines", "accept": "application/json"},
        )
        assert r.json() == {"predictions": [" the", " the quick brown"]}


async def test_sagemaker_json_lines_bad_line_is_400(served):
    async with served.client() as http:
        r = await http.post(
            "/invocations",
            content=b'{"inputs": "Hello"}\n{"nope": 1}\n',
            headers={"content-type": "application/jsonlines"},
        )
    assert r.status_code == 400
    assert r.json()["error"].startswith("line 2: Input Parsing failed. Ensure that the request payload is valid.")


async def test_sagemaker_csv_prompts(served):
    async with served.client() as http:
        r = await http.post(
            "/invocations",
            content=b'Hello\n"Hi, there"\n',
            headers={"content-type": "text/csv", "accept": "application/jsonlines"},
        )
    assert r.status_code == 200, r.text
    assert r.content == (json.dumps({"generated_text": FOX}) + "\n").encode() * 2
    assert [req.prompt for req in served.fake.requests] == ["Hello", "Hi, there"]


# --- Vertex AI on the LLM ------------------------------------------------------------------------------------------


async def test_vertex_predict_and_health_routes_from_settings():
    served = text_app(
        vertex_predict_route="/vertex/predict", vertex_health_route="/vertex/health", vertex_deployed_model_id="8675309"
    )
    served.fake.reply(Script(text=FOX))
    async with served.client() as http:
        expected = await lmi_text(http, "Hello", max_new_tokens=5)
        r = await http.post(
            "/vertex/predict", json={"instances": ["Hello", {"prompt": "Hello"}], "parameters": {"max_new_tokens": 5}}
        )
        assert (r.status_code, r.json()) == (200, {"predictions": [expected] * 2, "deployedModelId": "8675309"})
        health = await http.get("/vertex/health")
        assert (health.status_code, health.json()) == (200, {})


async def test_vertex_default_routes_and_errors(served):
    async with served.client() as http:
        r = await http.post(
            "/v1/endpoints/1/deployedModels/2:predict", json={"instances": ["Hi"], "parameters": {"max_new_tokens": 2}}
        )
        assert (r.status_code, r.json()) == (200, {"predictions": [" the quick"], "deployedModelId": ""})
        r = await http.post("/v1/endpoints/1/deployedModels/2:predict", json={"instances": [1]})
        assert r.status_code == 400 and "is not of expected type: string" in r.json()["error"]
        r = await http.post("/v1/endpoints/1/deployedModels/2:predict", content=b"nope")
        assert r.status_code == 400 and r.json()["error"].startswith("JSON deserialization failed for the request data")
