"""Fuzz-ish: random mutations of valid V2, TF Serving, SageMaker and Vertex bodies never get a 500 (or a
non-JSON answer) from the tensor protocols. Seeded, bounded in count."""

from __future__ import annotations

import json
import random

import pytest

from helpers.tensor_app import affine_model, client, tensor_app, text_model, two_input_model

SEEDS = range(80)
JUNK = [None, True, 0, -1, 1.5, 2**70, "", "x", [], {}, [[1, [2]]], {"b64": "@@"}, {"b64": 1}, [None], "NaN", -(2**63)]


def mutate(value, rng: random.Random, depth: int = 0):
    """Replace, drop or wrap one random part of a JSON value."""
    if rng.random() < 0.25 or depth > 6:
        return rng.choice(JUNK)
    if isinstance(value, dict) and value:
        key = rng.choice(list(value))
        out = dict(value)
        choice = rng.random()
        if choice < 0.2:
            del out[key]
        elif choice < 0.3:
            out[key + "_"] = rng.choice(JUNK)
        else:
            out[key] = mutate(value[key], rng, depth + 1)
        return out
    if isinstance(value, list) and value:
        index = rng.randrange(len(value))
        out = list(value)
        choice = rng.random()
        if choice < 0.2:
            del out[index]
        elif choice < 0.3:
            out.append(rng.choice(JUNK))
        elif choice < 0.4:
            out[index] = [out[index]]
        else:
            out[index] = mutate(value[index], rng, depth + 1)
        return out
    return rng.choice(JUNK)


V2 = (
    "/v2/models/{m}/infer",
    {
        "affine": {
            "id": "a",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [[1, 2, 3, 4], [5, 6, 7, 8]]}],
            "outputs": [{"name": "y", "parameters": {"binary_data": False}}],
            "parameters": {"content_type": "np"},
        },
        "two": {
            "inputs": [
                {"name": "a", "datatype": "FP64", "shape": [1, 2], "data": [1, 2]},
                {"name": "b", "datatype": "INT32", "shape": [1], "data": [3]},
            ]
        },
        "text": {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [2],
                    "data": ["a", "b"],
                    "parameters": {"content_type": "str"},
                }
            ]
        },
    },
)
TF = (
    "/v1/models/{m}:predict",
    {
        "affine": {"instances": [[1, 2, 3, 4], [5, 6, 7, 8]]},
        "two": {"signature_name": "serving_default", "inputs": {"a": [[1, 2]], "b": [3]}},
        "text": {"instances": [{"text": "a"}, {"text": {"b64": "YQ=="}}]},
    },
)
VERTEX = (
    "/v1/endpoints/e/deployedModels/{m}:predict",
    {
        "affine": {"instances": [[1, 2, 3, 4]], "parameters": {}},
    },
)
SAGEMAKER = (
    "/invocations?model_name={m}",
    {
        "affine": {"instances": [[1, 2, 3, 4]]},
        "two": [{"a": [1, 2], "b": 3}],
        "text": ["a", "b"],
    },
)


MODELS = {"affine": affine_model, "two": two_input_model, "text": text_model}


@pytest.mark.parametrize("protocol", [V2, TF, VERTEX, SAGEMAKER], ids=["v2", "tfserving", "vertex", "sagemaker"])
async def test_mutated_bodies_never_500(protocol):
    path, bodies = protocol
    app = tensor_app({name: MODELS[name]() for name in bodies})  # Vertex: one model, the default
    answered = set()
    async with client(app) as http:
        for seed in SEEDS:
            rng = random.Random(seed)
            model = rng.choice(sorted(bodies))
            body = json.dumps(mutate(bodies[model], rng)).encode()
            r = await http.post(
                path.format(m=model if protocol is not VERTEX else "d"),
                content=body,
                headers={"content-type": "application/json"},
            )
            assert r.status_code < 500, (body, r.status_code, r.text)
            assert "error" in r.json() if r.status_code >= 400 else r.content, (body, r.text)
            answered.add(r.status_code)
    assert {200, 400} <= answered  # both the model and the error paths are reached
