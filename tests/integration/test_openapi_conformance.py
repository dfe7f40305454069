"""schemathesis against GET /openapi.json on a real server: for every documented operation, requests
generated from the document's schemas get no 5xx, a documented status, a documented content type and
a body that fits the documented schema.

Bounded so it stays fast and repeatable: few examples per operation, derandomized, no example
database, and a server whose limits keep every generation short (the tiny model's 256-token context).
The served model's name is added to the document as the example of the model path parameters
(except on DELETE, which would unregister it), so inference operations reach the model, not only its
404s.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from helpers.server import run_server

VERTEX_PREDICT, VERTEX_HEALTH = "/vertex/predict", "/vertex/health"
MODEL_PARAMS = ("model_name", "model", "deployed_model")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    env = {"AIP_PREDICT_ROUTE": VERTEX_PREDICT, "AIP_HEALTH_ROUTE": VERTEX_HEALTH}
    args = ["--model-id", str(tiny_model_dir), "-o", "max_new_tokens=8", "-o", "max_input_len=64"]
    with run_server(args, env=env) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        yield url, name


def with_model_examples(doc: dict[str, Any], model: str) -> dict[str, Any]:
    """`doc` with `model` as the example of every model path parameter (not on DELETE)."""
    doc = copy.deepcopy(doc)
    for item in doc["paths"].values():
        for method, op in item.items():
            for param in op.get("parameters", []):
                if param["in"] == "path" and param["name"] in MODEL_PARAMS and method != "delete":
                    param["schema"]["examples"] = [model]
                    param["example"] = model
    return doc


@pytest.fixture(scope="module")
def api_schema(live: tuple[str, str]) -> schemathesis.BaseSchema:
    url, model = live
    doc = httpx.get(url + "/openapi.json", timeout=30, trust_env=False).json()
    schema = schemathesis.openapi.from_dict(with_model_examples(doc, model))
    schema.config.update(base_url=url)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=8,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_the_server_answers_as_documented(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=CHECKS, timeout=60)
