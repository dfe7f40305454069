"""The bundled model's files served from each source a model can be fetched from, by a real `lmiserve serve`
through the real clients (huggingface_hub, boto3, google-cloud-storage) against local servers of their APIs:
the Hub as a GGUF repository (`org/repo:Q4_1`, llama.cpp's `-hf` convention), an S3 prefix and a GCS prefix
(Vertex AI's AIP_STORAGE_URI). Every source gives the greedy answers of the bundled model served from disk."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from helpers.hub_server import FakeHub
from helpers.object_stores import gcs_server, s3_server
from helpers.server import run_server
from lmiserve.models.bundled import bundled_gguf_path

QUESTIONS = ("What is the capital of France?", "Name a primary colour.")
GGUF_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"


def answers(url: str) -> list[str]:
    found = []
    for question in QUESTIONS:
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        found.append(response.json()["choices"][0]["message"]["content"])
    return found


@pytest.fixture(scope="module")
def local(server_pool, smollm_dir) -> list[str]:  # smollm_dir converts the bundled GGUF into the user cache once
    return answers(server_pool.url([], timeout=300))  # `make serve`'s server, shared with the other e2e modules


def test_the_bundled_gguf_from_a_hub_repository(local: list[str], tmp_path: Path) -> None:
    gguf = bundled_gguf_path()
    with FakeHub() as hub:
        hub.add_repo(GGUF_REPO, {gguf.name: gguf, "SmolLM2-135M-Instruct.Q8_0.gguf": b"GGUF other", "README.md": b""})
        env = {
            **hub.env(),
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
            "HF_TOKEN": "",
        }
        with run_server(["--model-id", f"{GGUF_REPO}:Q4_1"], env=env, timeout=300) as url:
            assert answers(url) == local
        assert hub.downloads(GGUF_REPO, "SmolLM2-135M-Instruct.Q8_0.gguf") == 0  # one file of the repository


def test_the_bundled_gguf_from_s3(local: list[str], tmp_path: Path) -> None:
    gguf = bundled_gguf_path()
    with s3_server() as s3:
        s3.upload("models", f"smollm2/{gguf.name}", gguf.read_bytes())
        args = ["--model-id", "s3://models/smollm2", "-o", f"download_dir={tmp_path}"]
        with run_server(args, env=s3.env, timeout=300) as url:
            assert answers(url) == local


def test_the_bundled_gguf_from_gcs_as_vertex_names_it(local: list[str], tmp_path: Path) -> None:
    gguf = bundled_gguf_path()
    with gcs_server() as gcs:
        gcs.upload("artifacts", f"smollm2/{gguf.name}", gguf.read_bytes())
        env = {**gcs.env, "AIP_STORAGE_URI": "gs://artifacts/smollm2", "OPTION_DOWNLOAD_DIR": str(tmp_path)}
        with run_server([], env=env, timeout=300) as url:
            assert answers(url) == local
