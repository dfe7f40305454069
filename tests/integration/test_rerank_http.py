"""Rerank and score routes on real servers with a tiny random CrossEncoder (a one-label BERT classifier):
TEI's /rerank, the Jina/Cohere shape at /v1/rerank and /v2/rerank, vLLM's /score and /v1/score, plain
httpx. A score is checked against the model's logit for the (query, document) pair, computed here with
transformers (sigmoid of it where the protocol says so). Also: the routes are counted in the metrics per
protocol and model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

EMBED, RERANK = "tiny-embed", "tiny-rerank"
QUERY = "good movie"
DOCS = ["hello world", "bad film", "the quick brown fox", "good movie and good food", "i hate this film"]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "embeddings"
ATOL = 2e-5


@pytest.fixture(scope="module")
def logits(text_encoder_dirs):
    """`logits(pairs)`: the reranker's logit of each (query, document) pair."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = text_encoder_dirs[RERANK]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()

    def compute(pairs: list[tuple[str, str]]) -> np.ndarray:
        out = []
        for query, doc in pairs:
            with torch.no_grad():
                out.append(float(model(**tokenizer(query, doc, return_tensors="pt")).logits[0, 0]))
        return np.array(out)

    return compute


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x)))


def test_the_tiny_reranker_tells_documents_apart(logits):
    assert len({round(float(v), 4) for v in logits([(QUERY, d) for d in DOCS])}) == len(DOCS)


# ---- TEI's /rerank ------------------------------------------------------------------------------------------


def test_tei_rerank_sigmoid_sorted(tei_server, logits):
    r = tei_server.post({"query": QUERY, "texts": DOCS}, path="/rerank")
    assert r.status_code == 200, r.text
    ranks = r.json()
    expected = sigmoid(logits([(QUERY, d) for d in DOCS]))
    assert [x["index"] for x in ranks] == list(np.argsort(-expected))
    assert all(set(x) == {"index", "score"} for x in ranks)
    np.testing.assert_allclose([x["score"] for x in ranks], np.sort(expected)[::-1], atol=ATOL)


def test_tei_rerank_raw_scores_and_text(tei_server, logits):
    r = tei_server.post({"query": QUERY, "texts": DOCS, "raw_scores": True, "return_text": True}, path="/rerank")
    expected = logits([(QUERY, d) for d in DOCS])
    for rank in r.json():
        assert rank["text"] == DOCS[rank["index"]]
        assert rank["score"] == pytest.approx(expected[rank["index"]], abs=ATOL)


def test_tei_rerank_truncation(tei_server, logits):
    long = " ".join(["film"] * 80)
    too_long = tei_server.post({"query": QUERY, "texts": [long]}, path="/rerank")
    assert (too_long.status_code, too_long.json()["error_type"]) == (413, "Validation")
    r = tei_server.post({"query": QUERY, "texts": [long], "truncate": True, "raw_scores": True}, path="/rerank")
    assert r.status_code == 200, r.text
    # longest first: the query's 2 tokens stay, the document keeps 64 - 3 - 2 = 59
    assert r.json()[0]["score"] == pytest.approx(logits([(QUERY, " ".join(["film"] * 59))])[0], abs=ATOL)


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [({"query": "q", "texts": []}, 400, "Empty"), ({"query": "q", "texts": ["x"] * 2049}, 413, "Validation")],
)
def test_tei_rerank_errors(tei_server, body, status, error_type):
    r = tei_server.post(body, path="/rerank")
    assert (r.status_code, r.json()["error_type"]) == (status, error_type), r.text


# ---- Jina / Cohere: /v1/rerank and /v2/rerank --------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_jina_cohere_shape(encoder_server, logits, text_encoder_dirs, path):
    from transformers import AutoTokenizer

    documents = [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]
    r = encoder_server.post({"model": RERANK, "query": QUERY, "documents": documents, "top_n": 3}, path=path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["id", "model", "usage", "results"]
    assert body["model"] == RERANK and re.fullmatch(r"rerank-[0-9a-f]{32}", body["id"])
    tokenizer = AutoTokenizer.from_pretrained(text_encoder_dirs[RERANK])
    assert body["usage"] == {"total_tokens": sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCS)}
    expected = sigmoid(logits([(QUERY, d) for d in DOCS]))
    best = list(np.argsort(-expected)[:3])
    assert [x["index"] for x in body["results"]] == best
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=ATOL)
        assert result["document"] == {"text": DOCS[result["index"]]}


def test_rerank_without_documents_in_the_answer(encoder_server):
    r = encoder_server.post({"query": QUERY, "documents": DOCS, "return_documents": False}, path="/v1/rerank")
    assert r.status_code == 200, r.text  # no model: the only reranker
    assert all(set(x) == {"index", "relevance_score"} for x in r.json()["results"])
    assert len(r.json()["results"]) == len(DOCS)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": EMBED, "query": "q", "documents": ["a"]}, 400, "model"),
        ({"model": "tiny", "query": "q", "documents": ["a"]}, 400, "model"),
        ({"model": "nope", "query": "q", "documents": ["a"]}, 404, "model"),
        ({"query": "q", "documents": []}, 400, "documents"),
        ({"query": "q", "documents": [{"txt": "a"}]}, 400, None),
        ({"query": "q", "documents": ["a"], "top_n": -1}, 400, None),
        ({"query": "q", "documents": ["a"], "rank_fields": ["x"]}, 400, None),
    ],
)
def test_rerank_errors_are_openais_error_object(encoder_server, body, status, param):
    r = encoder_server.post(body, path="/v1/rerank")
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


# ---- vLLM's /score -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_one_to_many(encoder_server, logits, path):
    r = encoder_server.post({"model": RERANK, "text_1": QUERY, "text_2": DOCS}, path=path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert body["object"] == "list" and body["id"].startswith("score-") and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in body["data"])
    expected = sigmoid(logits([(QUERY, d) for d in DOCS]))
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=ATOL)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


def test_score_pairs_position_by_position(encoder_server, logits):
    first = ["good movie", "bad film"]
    r = encoder_server.post({"text_1": first, "text_2": DOCS[:2]}, path="/score")
    np.testing.assert_allclose(
        [d["score"] for d in r.json()["data"]], sigmoid(logits(list(zip(first, DOCS[:2])))), atol=ATOL
    )
    single = encoder_server.post({"text_1": ["good movie"], "text_2": "bad film"}, path="/score").json()
    assert single["data"][0]["score"] == pytest.approx(sigmoid(logits([("good movie", "bad film")]))[0], abs=ATOL)


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "text_1", None),
        ({"text_1": [], "text_2": ["a"]}, 400, "text_1", None),
        ({"text_1": "a", "text_2": " ".join(["film"] * 80)}, 400, "text_2", "context_length_exceeded"),
        ({"model": EMBED, "text_1": "a", "text_2": "b"}, 400, "model", None),
        ({"model": "nope", "text_1": "a", "text_2": "b"}, 404, "model", "model_not_found"),
        ({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 4}, 400, None, None),
    ],
)
def test_score_errors(encoder_server, body, status, param, code):
    r = encoder_server.post(body, path="/v1/score")
    assert r.status_code == status, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)


# ---- golden wire formats, metrics -----------------------------------------------------------------------------


def masked(value, key=""):
    if key == "id":
        return "<id>"
    if key == "created":
        return 0
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return [masked(v) for v in value]
    if isinstance(value, dict):
        return {k: masked(v, k) for k, v in value.items()}
    return value


@pytest.mark.parametrize(
    ("golden", "path", "body"),
    [
        ("tei_rerank.json", "/rerank", {"query": QUERY, "texts": DOCS[:3], "return_text": True}),
        ("rerank.json", "/v1/rerank", {"query": QUERY, "documents": DOCS[:3], "top_n": 2}),
        ("score.json", "/score", {"text_1": QUERY, "text_2": DOCS[:2]}),
        ("tei_error.json", "/rerank", {"query": QUERY, "texts": [" ".join(["film"] * 80)]}),
    ],
)
def test_wire_format_golden(tei_server, golden, path, body):
    r = tei_server.post(body, path=path)
    assert r.content == json.dumps(r.json(), separators=(",", ":")).encode()
    assert json.dumps(masked(r.json())) == json.dumps(json.loads((GOLDEN / golden).read_text()))


def counted(server, protocol: str, model: str, status: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"protocol": protocol, "model": model, "status": status}
    return sum(
        s.value
        for family in text_string_to_metric_families(server.get("/metrics").text)
        for s in family.samples
        if s.name == "lmiserve_requests_total" and s.labels == wanted
    )


def test_the_routes_are_counted_per_protocol_and_model(tei_server):
    before = {
        key: counted(tei_server, *key)
        for key in [("tei", RERANK, "200"), ("openai", RERANK, "200"), ("openai", EMBED, "200"), ("tei", "", "400")]
    }
    tei_server.post({"query": "q", "texts": ["a"]}, path="/rerank")
    tei_server.post({"text_1": "q", "text_2": "a"}, path="/score")
    tei_server.post({"input": "a"}, path="/v1/embeddings")
    tei_server.post({"query": "q", "texts": []}, path="/rerank")
    after = {key: counted(tei_server, *key) for key in before}
    assert {key: after[key] - before[key] for key in before} == dict.fromkeys(before, 1.0)
    assert not math.isnan(sum(after.values()))
