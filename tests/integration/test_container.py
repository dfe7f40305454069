"""The container's entrypoint (`python -m lmiserve.container`, the Dockerfile's ENTRYPOINT) on real
processes, without Docker: a temporary directory laid out like SageMaker's /opt/ml/model (the tiny
model and a serving.properties), pointed at by SM_MODEL_DIR; and Vertex AI's AIP_* variables.
The entrypoint execs lmiserve, so the process the test signals is the server itself."""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import httpx
import pytest

from helpers.serve_process import HANG_TIMEOUT, ServeProcess
from helpers.server import free_port

pytestmark = pytest.mark.e2e  # the slowest tier: the container's entrypoint on real processes

ENTRYPOINT = [sys.executable, "-m", "lmiserve.container"]


@pytest.fixture(scope="module")
def model_root(tiny_model_dir, tmp_path_factory) -> Path:
    """/opt/ml/model as SageMaker extracts a model.tar.gz: the model files and serving.properties."""
    root = tmp_path_factory.mktemp("sagemaker") / "opt" / "ml" / "model"
    shutil.copytree(tiny_model_dir, root)
    (root / "serving.properties").write_text("option.model_name=sm-model\n")
    return root


def assert_stops_cleanly(server: ServeProcess) -> None:
    server.send(signal.SIGTERM)
    assert server.wait_exit() == 0, server.describe()
    assert "Traceback" not in server.stderr()


def test_sagemaker_serve_serves_the_model_directory_with_its_serving_properties(model_root):
    with (
        ServeProcess(["serve"], env={"SM_MODEL_DIR": str(model_root)}, command=ENTRYPOINT) as server,
        httpx.Client(base_url=server.url, timeout=HANG_TIMEOUT, trust_env=False) as c,
    ):
        server.wait_healthy()
        assert f"lmiserve-container: serving the model directory {model_root}" in server.stderr()
        r = c.get("/ping")
        assert (r.status_code, r.json()) == (200, {"sm-model": {"status": "Healthy"}})  # model_name from the file
        r = c.post("/invocations", json={"inputs": "Deep learning is", "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 200, r.text
        assert r.json()["generated_text"]
        assert_stops_cleanly(server)


def test_vertex_port_routes_and_a_local_storage_uri(model_root):
    port = free_port()
    env = {
        "AIP_HTTP_PORT": str(port),
        "AIP_HEALTH_ROUTE": "/vertex/health",
        "AIP_PREDICT_ROUTE": "/vertex/predict",
        "AIP_STORAGE_URI": f"file://{model_root}",
        "SM_MODEL_DIR": str(model_root.parent / "absent"),  # AIP_STORAGE_URI wins
        "OPTION_HOST": "127.0.0.1",
    }
    with (
        ServeProcess([], env=env, port=port, command=ENTRYPOINT, address=False) as server,
        httpx.Client(base_url=server.url, timeout=HANG_TIMEOUT, trust_env=False) as c,
    ):
        server.wait_healthy()  # listening on AIP_HTTP_PORT
        assert f"serving the model directory {model_root}" in server.stderr()
        assert c.get("/vertex/health").status_code == 200
        r = c.post("/vertex/predict", json={"instances": ["Deep learning is"], "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert len(r.json()["predictions"]) == 1
        assert_stops_cleanly(server)


def test_other_commands_run_as_given():
    with ServeProcess(["-c", "print('hello from the container')"], command=[*ENTRYPOINT, "python"], address=False) as p:
        assert p.wait_exit() == 0, p.describe()
        p._out.seek(0)
        assert p._out.read().decode() == "hello from the container\n"
