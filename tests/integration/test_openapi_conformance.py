"""schemathesis against the API document on a real server: for every documented operation, requests
generated from the document's schemas get no 5xx, a documented status, a documented content type and
a body that fits the documented schema.

The document is the one the server serves at GET /openapi.json (`test_openapi.py` checks that the
served one is this one), built at collection time so schemathesis can parametrize the test by
operation. Bounded so it stays fast and repeatable: few examples per operation, derandomized, no
example database, and a server whose limits keep every generation short. Model path parameters are
set to the served model's name (except on DELETE, which would unregister it), so inference operations
reach the model, not only its 404s.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
from lmiserve.config import Settings
from lmiserve.server.app import routes
from lmiserve.server.openapi import build

VERTEX_PREDICT, VERTEX_HEALTH = "/vertex/predict", "/vertex/health"
VERTEX_ENV = {"AIP_PREDICT_ROUTE": VERTEX_PREDICT, "AIP_HEALTH_ROUTE": VERTEX_HEALTH}
MODEL_PARAMS = ("model_name", "model", "deployed_model")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Every answer is short: at most 8 new tokens (LMI, V2 generate) and 24 tokens in all (TGI, OpenAI).
LIMITS = ("max_new_tokens=8", "max_new_tokens_limit=8", "max_total_tokens=24", "max_input_tokens=16")
DOCUMENT = build(routes(Settings(vertex_predict_route=VERTEX_PREDICT, vertex_health_route=VERTEX_HEALTH)))


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    args = ["--model-id", str(tiny_model_dir)]
    for option in LIMITS:
        args += ["-o", option]
    with run_server(args, env=VERTEX_ENV) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        yield url, name


schema = schemathesis.openapi.from_dict(DOCUMENT)
# the examples in the document, then `max_examples` generated cases; not the coverage phase, which
# generates every boundary case of every schema (minutes per operation here)
schema.config.phases.update(phases=["examples", "fuzzing"])


@schema.parametrize()
@settings(
    max_examples=6,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_the_server_answers_as_documented(live: tuple[str, str], case: schemathesis.Case) -> None:
    url, model = live
    if case.method != "DELETE":
        for name in MODEL_PARAMS:
            if name in (case.path_parameters or {}):
                case.path_parameters[name] = model
    case.call_and_validate(base_url=url, checks=CHECKS, timeout=60)
