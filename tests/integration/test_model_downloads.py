"""Models fetched at start by a real `lmiserve serve` (docs/models.md): from a Hub (a local Hub-API server,
helpers.hub_server), S3 (moto's server) and GCS (an emulator), through the real clients. Each serves the tiny
model's greedy answers; /ping answers 503 while the model downloads; a killed download resumes; a second start
needs no network; two processes download once; a failure is one line and exit status 5; the management API
fetches only what `allowed_model_urls` lists."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.hub_server import FakeHub
from helpers.object_stores import gcs_server, s3_server
from helpers.serve_process import ServeProcess
from helpers.server import REPO_ROOT, run_server
from helpers.waiting import wait_until

PROMPTS = ("The capital of France is", "Hello, how", "1, 2, 3,")
REPO = "org/tiny"


def greedy(url: str) -> list[str]:
    answers = []
    for prompt in PROMPTS:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "do_sample": False}}
        response = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answers.append(response.json()["generated_text"])
    return answers


@pytest.fixture(scope="module")
def local_answers(tiny_model_dir: Path) -> list[str]:
    """The greedy answers of the tiny model served from its local directory."""
    with run_server(["--model-id", str(tiny_model_dir)]) as url:
        return greedy(url)


@pytest.fixture
def hub(tiny_model_dir: Path) -> Iterator[FakeHub]:
    with FakeHub() as server:
        server.add_repo(REPO, tiny_model_dir)
        yield server


def hub_env(hub: FakeHub, home: Path, **extra: str) -> dict[str, str]:
    no_token = {"HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": ""}  # whatever the machine running the tests has
    return {**hub.env(), **no_token, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), **extra}


def one_line_failure(process: ServeProcess) -> list[str]:
    """The lines of stderr that are not log lines (the `lmiserve: ...` failure line), and no traceback."""
    text = process.stderr()
    assert "Traceback" not in text, text
    return [line for line in text.splitlines() if line.startswith("lmiserve:")]


def test_hub_model_serves_the_local_models_answers_then_starts_offline(
    hub: FakeHub, tmp_path: Path, local_answers: list[str]
) -> None:
    env = hub_env(hub, tmp_path / "hf")
    with run_server(["--model-id", REPO], env=env) as url:
        assert greedy(url) == local_answers
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["org_tiny"]
    hub.stop()  # a second start needs no network: HF_HUB_OFFLINE, or the Hub simply down
    with run_server(["--model-id", REPO], env={**env, "HF_HUB_OFFLINE": "1"}) as url:
        assert greedy(url) == local_answers
    with run_server(["--model-id", REPO, "-o", "download_retries=0"], env=env) as url:
        assert greedy(url) == local_answers


def test_ping_is_503_while_downloading_and_a_killed_download_resumes(hub: FakeHub, tmp_path: Path) -> None:
    env = hub_env(hub, tmp_path / "hf")
    parts_of = {name: -(-size // 65536) for name, size in _sizes(hub).items()}
    hub.bytes_per_second = 200_000
    args = ["--model-id", REPO, "-o", "download_part_size=64KiB"]
    blobs = tmp_path / "hf" / "hub" / "models--org--tiny" / "blobs"
    weights = max(_sizes(hub).values())  # the safetensors file is the largest

    def parts_written() -> int:
        records = [json.loads(p.read_text()) for p in blobs.glob("*.incomplete.json")] if blobs.is_dir() else []
        return sum(len(r["done"]) for r in records if r["size"] == weights)

    with ServeProcess(args, env=env) as process:
        wait_until(lambda: parts_written() >= 2, "two parts of the weights are written")
        assert process.ping_status() == 503  # probes wait: the port answers, the model is not there yet
        process.send(signal.SIGKILL)
        process.wait_exit()
    written, first = parts_written(), hub.downloads(REPO, "model.safetensors")
    hub.bytes_per_second = None
    with ServeProcess(args, env=env) as process:
        process.wait_healthy()
        assert "resuming after" in process.stderr()
    second = hub.downloads(REPO, "model.safetensors") - first
    assert second == parts_of["model.safetensors"] - written  # the parts written before the kill are not read again


def test_two_processes_download_each_file_once(hub: FakeHub, tmp_path: Path) -> None:
    env = {**os.environ, **hub_env(hub, tmp_path / "hf"), "PYTHONPATH": str(REPO_ROOT)}
    hub.bytes_per_second = 400_000
    command = [sys.executable, "-m", "lmiserve", "download", REPO]
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]  # both print the same snapshot directory
    for name in _sizes(hub):
        assert hub.downloads(REPO, name) == 1, name


def test_a_gated_model_without_a_token_is_one_line_and_exit_5(hub: FakeHub, tiny_model_dir: Path, tmp_path: Path):
    hub.add_repo("org/gated", tiny_model_dir, gated=True, token="hf_secret")
    with ServeProcess(["--model-id", "org/gated"], env=hub_env(hub, tmp_path / "hf")) as process:
        assert process.wait_exit() == 5
        assert one_line_failure(process) == [
            "lmiserve: model download failed: org_gated: org/gated is a gated repository and HF_TOKEN is not set: "
            f"accept its conditions on {hub.url}/org/gated and set HF_TOKEN to a token of an account with access"
        ]
    env = hub_env(hub, tmp_path / "hf", HF_TOKEN="hf_secret")
    with run_server(["--model-id", "org/gated"], env=env) as url:
        assert httpx.get(f"{url}/ping", timeout=10).status_code == 200


def test_lmiserve_download_fills_the_cache_for_an_offline_start(hub: FakeHub, tmp_path: Path, local_answers):
    env = {**os.environ, **hub_env(hub, tmp_path / "hf"), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "lmiserve", "download", REPO], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_dir()
    assert "downloaded org/tiny" in done.stderr
    hub.stop()
    missing = subprocess.run(
        [sys.executable, "-m", "lmiserve", "download", "org/other", "-o", "download_retries=0"],
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 5
    assert missing.stderr.strip().splitlines()[-1] == (
        "lmiserve: model download failed: org/other: HF_HUB_OFFLINE is set and org/other is not in the Hugging Face "
        f"cache {tmp_path / 'hf' / 'hub'}: download it first (`lmiserve download org/other`) or unset HF_HUB_OFFLINE"
    )
    with run_server(["--model-id", REPO], env={**hub_env(hub, tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}) as url:
        assert greedy(url) == local_answers


def _sizes(hub: FakeHub) -> dict[str, int]:
    """Sizes of the files of REPO that serving fetches (from the Hub's own listing)."""
    listing = httpx.get(f"{hub.url}/api/models/{REPO}/tree/main", params={"recursive": "true"}, timeout=10).json()
    served = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    served.add("chat_template.jinja")
    return {entry["path"]: entry["size"] for entry in listing if entry["path"] in served}


def test_s3_model_serves_and_a_second_start_downloads_nothing(
    tiny_model_dir: Path, tmp_path: Path, local_answers: list[str]
) -> None:
    with s3_server() as s3:
        s3.upload_dir("models", "llm/tiny", tiny_model_dir)
        args = ["--model-id", "s3://models/llm/tiny", "-o", f"download_dir={tmp_path / 'dl'}"]
        with run_server(args, env=s3.env) as url:
            assert greedy(url) == local_answers
            models = httpx.get(f"{url}/v1/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == ["tiny"]  # the prefix's last part, as LMI names it
        assert s3.gets("models", "llm/tiny/model.safetensors") == 1
        with run_server(args, env=s3.env) as url:
            assert greedy(url) == local_answers
        assert s3.gets("models", "llm/tiny/model.safetensors") == 1  # the cache: nothing downloaded again


def test_vertex_aip_storage_uri_on_gcs(tiny_model_dir: Path, tmp_path: Path, local_answers: list[str]) -> None:
    with gcs_server() as gcs:
        gcs.upload_dir("vertex-artifacts", "model", tiny_model_dir)
        env = {**gcs.env, "AIP_STORAGE_URI": "gs://vertex-artifacts/model", "OPTION_DOWNLOAD_DIR": str(tmp_path)}
        with run_server([], env=env) as url:
            assert greedy(url) == local_answers


def test_the_management_apis_fetch_only_allowed_urls(
    hub: FakeHub, tiny_model_dir: Path, lora_adapter_dirs: dict[str, Path], tmp_path: Path, local_answers: list[str]
) -> None:
    hub.add_repo("org/alpha", lora_adapter_dirs["alpha"])
    hub.add_repo("org/beta", lora_adapter_dirs["beta"])
    with s3_server() as s3:
        s3.upload_dir("models", "shared/tiny", tiny_model_dir)
        s3.upload_dir("secret", "tiny", tiny_model_dir)
        env = {**hub_env(hub, tmp_path / "hf"), **s3.env}
        args = [
            "--model-id",
            str(tiny_model_dir),
            "-o",
            "enable_lora=true",
            "-o",
            "lora_modules=hub-alpha=org/alpha",  # named at start: the operator's, fetched without a check
            "-o",
            "allowed_model_urls=s3://models/shared/,hf://org/beta",
            "-o",
            f"download_dir={tmp_path / 'dl'}",
        ]
        with run_server(args, env=env) as url:
            names = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
            assert "hub-alpha" in names
            load = {"lora_name": "hub-beta", "lora_path": "org/beta"}
            loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60)
            assert loaded.status_code == 200, loaded.text
            other = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "hf://org/alpha"})
            assert other.status_code == 403, other.text
            completion = {"model": "hub-beta", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=completion, timeout=60).status_code == 200
            denied = httpx.post(f"{url}/models", params={"url": "s3://secret/tiny", "model_name": "x"}, timeout=60)
            assert denied.status_code == 403, denied.text
            assert "allowed_model_urls" in denied.text
            assert s3.gets("secret", "tiny/model.safetensors") == 0  # refused before a byte was read
            registered = httpx.post(
                f"{url}/models", params={"url": "s3://models/shared/tiny", "model_name": "from-s3"}, timeout=120
            )
            assert registered.status_code == 200, registered.text
            for prompt, expected in zip(PROMPTS, local_answers):
                body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "do_sample": False}}
                answer = httpx.post(f"{url}/predictions/from-s3", json=body, timeout=60).json()
                assert answer["generated_text"] == expected
