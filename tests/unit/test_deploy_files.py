"""deploy/ and the Dockerfile: the YAML parses into Kubernetes-shaped objects that agree with each other
and with lmiserve (probe routes, port, drain), and the SageMaker script builds valid requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmiserve.config import Settings

yaml = pytest.importorskip("yaml")  # PyYAML comes with transformers

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def load(name: str) -> dict:
    [doc] = list(yaml.safe_load_all((DEPLOY / name).read_text()))
    return doc


def test_every_yaml_file_is_a_kubernetes_object():
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert files
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), path
            group_version = doc["apiVersion"]  # `group/version`, or `v1` for the core group (Service)
            assert ("/" in group_version or group_version == "v1") and doc["kind"][0].isupper(), path
            assert doc["metadata"]["name"], path
            assert isinstance(doc["spec"], dict), path


def test_the_serving_runtime_probes_lmiserves_open_routes_on_its_port():
    runtime = load("kserve/servingruntime.yaml")
    assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1", "ServingRuntime")
    [container] = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container" and container["args"][0] == "serve"
    assert [p["containerPort"] for p in container["ports"]] == [Settings().port]
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"  # 200 during the drain
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"  # 503 from SIGTERM on
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LMISERVE_MODEL_DIR"] == "/mnt/models"  # where KServe's storage initializer puts storageUri
    Settings.from_options({"drain_timeout": env["OPTION_DRAIN_TIMEOUT"]})  # a valid value


def test_the_inference_service_uses_the_runtime_scales_on_the_queue_and_outlives_the_drain():
    runtime, service = load("kserve/servingruntime.yaml"), load("kserve/inferenceservice.yaml")
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    predictor = service["spec"]["predictor"]
    assert predictor["model"]["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert predictor["model"]["modelFormat"]["name"] in formats
    assert 1 <= predictor["minReplicas"] < predictor["maxReplicas"]
    [metric] = predictor["autoScaling"]["metrics"]
    assert "vllm:num_requests_waiting" in metric["external"]["metric"]["query"]
    assert service["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "keda"
    [container] = runtime["spec"]["containers"]
    drain = float({e["name"]: e["value"] for e in container["env"]}["OPTION_DRAIN_TIMEOUT"])
    assert predictor["terminationGracePeriodSeconds"] > drain


def test_the_sagemaker_script_builds_the_three_requests():
    args = ["--dry-run", "--image", "1.dkr.ecr/lmiserve:1", "--role", "arn:aws:iam::1:role/r", "--name", "ep"]
    out = subprocess.run(
        [sys.executable, str(DEPLOY / "sagemaker" / "deploy.py"), *args, "--model-data", "s3://b/model.tar.gz"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    calls = json.loads(out)
    assert list(calls) == ["create_model", "create_endpoint_config", "create_endpoint"]
    container = calls["create_model"]["PrimaryContainer"]
    assert container == {
        "Image": "1.dkr.ecr/lmiserve:1",
        "Environment": {"OPTION_DRAIN_TIMEOUT": "25"},
        "ModelDataUrl": "s3://b/model.tar.gz",
    }
    assert float(container["Environment"]["OPTION_DRAIN_TIMEOUT"]) < 30  # SageMaker kills 30 s after SIGTERM
    [variant] = calls["create_endpoint_config"]["ProductionVariants"]
    assert variant["ModelName"] == "ep" and calls["create_endpoint"]["EndpointConfigName"] == "ep"


def test_the_dockerfile_follows_the_sagemaker_contract():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python", "-m", "lmiserve.container"]' in text  # exec form: SIGTERM reaches lmiserve
    assert 'CMD ["serve"]' in text and "EXPOSE 8080" in text
    assert "ARG TORCH_VARIANT=cpu" in text and "download.pytorch.org/whl/${TORCH_VARIANT}" in text


def test_the_default_drain_fits_sagemakers_and_kubernetes_kill_delay():
    assert Settings().drain_timeout < 30


def test_the_sagemaker_script_deploys_a_model_downloaded_at_start():
    args = ["--dry-run", "--image", "1.dkr.ecr/lmiserve:1", "--role", "arn:aws:iam::1:role/r", "--name", "ep"]
    args += ["--model-id", "meta-llama/Llama-3.2-1B-Instruct", "--env", "HF_TOKEN=hf_x", "--startup-timeout", "1800"]
    out = subprocess.run(
        [sys.executable, str(DEPLOY / "sagemaker" / "deploy.py"), *args], capture_output=True, text=True, check=True
    ).stdout
    calls = json.loads(out)
    assert calls["create_model"]["PrimaryContainer"] == {
        "Image": "1.dkr.ecr/lmiserve:1",
        "Environment": {
            "OPTION_DRAIN_TIMEOUT": "25",
            "HF_MODEL_ID": "meta-llama/Llama-3.2-1B-Instruct",
            "HF_TOKEN": "hf_x",
        },
    }
    [variant] = calls["create_endpoint_config"]["ProductionVariants"]
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 1800
