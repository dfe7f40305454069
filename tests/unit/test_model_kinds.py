"""The one-shot model kinds loaded through ModelService (the server's path) and checked numerically:
all-MiniLM-L6-v2 embeddings, a tiny BERT classifier and regressor, a TorchScript module."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.tensor_models import CLASSIFIER_LABELS, affine_reference
from lmiserve.config import Settings
from lmiserve.core.errors import InvalidRequest
from lmiserve.core.tensors import TensorRequest
from lmiserve.models.kinds import detect_kind
from lmiserve.models.service import ModelService
from lmiserve.models.store import model_settings

SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an acoustic guitar on stage.",
    "The stock market fell sharply today.",
    "Bonjour, comment ça va ? 日本語",
]


def text(*values: str) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = [v.encode() for v in values]
    return out


async def loaded(path, **options) -> ModelService:
    service = ModelService(Settings.from_options({"model_id": str(path), **options}))
    await service.load()
    assert service.status == ModelService.READY, service.error
    return service


@pytest.fixture(scope="module")
def reference_minilm(minilm_dir):
    """A straightforward per-sentence transformers forward + mean pooling + L2 normalisation."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir).eval()

    def embed(sentence: str) -> np.ndarray:
        batch = tokenizer(sentence, return_tensors="pt", truncation=True, max_length=256)
        with torch.no_grad():
            states = model(**batch).last_hidden_state[0]
        vector = states.mean(dim=0)
        return (vector / vector.norm()).numpy()

    return embed


def test_kind_detection(minilm_dir, tiny_classifier_dir, torchscript_dir, tiny_model_dir):
    assert detect_kind(str(minilm_dir)) == "embedding"
    assert detect_kind(str(tiny_classifier_dir)) == "classifier"
    assert detect_kind(str(torchscript_dir)) == "torchscript"
    assert detect_kind(str(torchscript_dir / "affine.pt")) == "torchscript"
    assert detect_kind(str(tiny_model_dir)) == "llm"
    assert detect_kind(None) == "llm"
    assert detect_kind(str(tiny_model_dir), "embedding") == "embedding"
    assert detect_kind(str(tiny_classifier_dir), "regression") == "classifier"


async def test_minilm_embeddings_match_a_reference_computation(minilm_dir, reference_minilm):
    service = await loaded(minilm_dir, batch_size=8)
    try:
        model = service.tensor_model
        assert model.kind == "embedding"
        assert [(t.name, t.datatype, t.shape) for t in model.signature.outputs] == [("embedding", "FP32", (-1, 384))]
        out = await model.infer(TensorRequest({"text": text(*SENTENCES)}))
        emb = out["embedding"]
        assert emb.dtype == np.float32 and emb.shape == (4, 384)
        np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
        expected = np.stack([reference_minilm(s) for s in SENTENCES])
        np.testing.assert_allclose(emb, expected, atol=2e-5)  # padding in the batch changes nothing
        cos = emb @ emb.T
        assert cos[0, 1] > 0.5 > cos[0, 2]  # two guitar sentences are close, the market is not
        assert cos[0, 1] > cos[1, 2]
    finally:
        await service.close()


async def test_embedding_input_names_and_errors(minilm_dir):
    service = await loaded(minilm_dir)
    try:
        model = service.tensor_model
        single = await model.infer(TensorRequest({"text": text(SENTENCES[0]).reshape(1, 1)}))
        assert single["embedding"].shape == (1, 384)
        with pytest.raises(InvalidRequest) as info:  # an input the model does not declare: never taken as `text`
            await model.infer(TensorRequest({"inputs": text(SENTENCES[0])}))
        assert info.value.message == f"unexpected inference input 'inputs' for model '{service.name}'"
        with pytest.raises(InvalidRequest, match="must hold text"):
            await model.infer(TensorRequest({"text": np.array([[1.0, 2.0]], dtype=np.float32)}))
        with pytest.raises(InvalidRequest, match="unknown output"):
            await model.infer(TensorRequest({"text": text("x")}, outputs=["label"]))
    finally:
        await service.close()


async def test_classifier_labels_and_probabilities_equal_the_model(tiny_classifier_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    service = await loaded(tiny_classifier_dir, batch_size=4)
    try:
        model = service.tensor_model
        assert model.kind == "classifier"
        assert [(t.name, t.datatype, t.shape) for t in model.signature.outputs] == [
            ("label", "BYTES", (-1,)),
            ("probabilities", "FP32", (-1, 3)),
        ]
        rows = ["the movie was good", "terrible food and bad service", "hello world", "ok"]
        out = await model.infer(TensorRequest({"text": text(*rows)}))
        probs = out["probabilities"]
        assert probs.shape == (4, 3) and probs.dtype == np.float32
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-6)
        tokenizer = AutoTokenizer.from_pretrained(tiny_classifier_dir)
        reference = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir).eval()
        for i, row in enumerate(rows):
            with torch.no_grad():
                expected = torch.softmax(reference(**tokenizer(row, return_tensors="pt")).logits[0], -1).numpy()
            np.testing.assert_allclose(probs[i], expected, atol=1e-5)
            assert out["label"][i].decode() == CLASSIFIER_LABELS[int(expected.argmax())]
        only_labels = await model.infer(TensorRequest({"text": text(*rows)}, outputs=["label"]))
        assert list(only_labels) == ["label"]
    finally:
        await service.close()


async def test_regression_head_gives_a_score(tiny_regressor_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    service = await loaded(tiny_regressor_dir)
    try:
        model = service.tensor_model
        assert model.kind == "regression"
        assert [(t.name, t.datatype) for t in model.signature.outputs] == [("score", "FP32")]
        out = await model.infer(TensorRequest({"text": text("good movie", "bad movie")}))
        tokenizer = AutoTokenizer.from_pretrained(tiny_regressor_dir)
        reference = AutoModelForSequenceClassification.from_pretrained(tiny_regressor_dir).eval()
        with torch.no_grad():
            expected = [
                reference(**tokenizer(s, return_tensors="pt")).logits[0, 0].item() for s in ("good movie", "bad movie")
            ]
        np.testing.assert_allclose(out["score"], expected, atol=1e-5)
    finally:
        await service.close()


async def test_torchscript_model_from_serving_properties(torchscript_dir):
    settings = model_settings(Settings(), torchscript_dir, "affine")
    service = ModelService(settings)
    await service.load()
    try:
        assert service.status == ModelService.READY, service.error
        model = service.tensor_model
        assert model.kind == "torchscript"
        assert [(t.name, t.datatype, t.shape) for t in model.signature.inputs] == [("x", "FP32", (-1, 4))]
        assert [(t.name, t.datatype, t.shape) for t in model.signature.outputs] == [
            ("y", "FP32", (-1, 2)),
            ("best", "INT64", (-1,)),
        ]
        x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
        out = await model.infer(TensorRequest({"x": x}))
        y, best = affine_reference(x)
        np.testing.assert_allclose(out["y"], y, rtol=1e-6)
        assert out["best"].dtype == np.int64 and out["best"].tolist() == best.tolist()
        ints = await model.infer(TensorRequest({"x": x.astype(np.int64)}, outputs=["best"]))  # ints cast
        assert list(ints) == ["best"] and ints["best"].tolist() == best.tolist()
        with pytest.raises(InvalidRequest) as info:  # one input, but not its name: refused
            await model.infer(TensorRequest({"input": x}))
        assert info.value.message == f"unexpected inference input 'input' for model '{service.name}'"
        for bad, message in [
            (np.zeros((2, 3), np.float32), r"must have shape \[-1, 4\], got \[2, 3\]"),
            (np.zeros(4, np.float32), r"must have shape \[-1, 4\], got \[4\]"),
            (np.array([[b"a"] * 4], dtype=object), "must be FP32"),
        ]:
            with pytest.raises(InvalidRequest, match=message):
                await model.infer(TensorRequest({"x": bad}))
        with pytest.raises(InvalidRequest, match=f"^unexpected inference input 'z' for model '{service.name}'$"):
            await model.infer(TensorRequest({"x": x, "z": x}))
    finally:
        await service.close()


def test_torchscript_signature_errors():
    from lmiserve.models import ModelLoadError
    from lmiserve.models.tensor_models import torchscript_signature

    default = torchscript_signature(Settings())
    assert [(t.name, t.datatype, t.shape) for t in default.inputs] == [("input__0", "FP32", (-1,))]
    with pytest.raises(ModelLoadError, match="different numbers"):
        torchscript_signature(Settings(input_names="a,b", input_dtypes="FP32"))
    with pytest.raises(ModelLoadError, match="not one of"):
        torchscript_signature(Settings(input_dtypes="FLOAT"))
    with pytest.raises(ModelLoadError, match="list of integers"):
        torchscript_signature(Settings(input_shapes="-1,x"))


async def test_load_failure_is_reported(tmp_path):
    (tmp_path / "broken.pt").write_bytes(b"not a torchscript file")
    service = ModelService(Settings.from_options({"model_id": str(tmp_path)}))
    await service.load()
    assert service.status == ModelService.FAILED and "could not load the TorchScript module" in service.error
