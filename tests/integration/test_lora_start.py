"""Adapters named at start, each way a user brings them: TGI's `LORA_ADAPTERS` environment variable and
LMI's `adapters/` folder next to the model (with `option.enable_lora=true` in its serving.properties);
an adapter named at start that does not load keeps the model from becoming ready, and /ping says why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from helpers.server import REPO_ROOT, free_port, run_server

pytestmark = pytest.mark.integration


def test_lora_adapters_env_and_the_adapters_folder_register_at_start(tiny_model_dir, lora_adapter_dirs, tmp_path):
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model)
    shutil.copytree(lora_adapter_dirs["alpha"], model / "adapters" / "alpha")
    (model / "serving.properties").write_text("option.enable_lora=true\n", encoding="utf-8")
    env = {"LORA_ADAPTERS": f"{lora_adapter_dirs['beta']}"}  # a bare path: named after its folder
    with run_server(["--model-id", str(model)], env=env) as url, httpx.Client(base_url=url, timeout=60) as client:
        models = client.get("/v1/models").json()["data"]
        adapters = {m["id"]: (m["parent"], m["root"]) for m in models if m.get("parent")}
        assert adapters == {
            "alpha": ("tiny", str(model / "adapters" / "alpha")),
            "beta": ("tiny", str(lora_adapter_dirs["beta"])),
        }
        texts = {
            name: client.post(
                "/generate", json={"inputs": "Hello there", "parameters": {"max_new_tokens": 6, "adapter_id": name}}
            ).json()["generated_text"]
            for name in ("alpha", "beta", "")
        }
        assert len(set(texts.values())) == 3  # each adapter answers, differently from the base model


def test_an_adapter_that_does_not_load_at_start_stops_the_server_naming_it(tiny_model_dir, tmp_path):
    """As a model that does not load: exit status 1 and one stderr line naming the adapter and why."""
    missing = tmp_path / "nowhere"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmiserve",
            "serve",
            "--model-id",
            str(tiny_model_dir),
            "--port",
            str(free_port()),
            "-o",
            f"lora_modules=x={missing}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 1
    assert (
        f"model load failed: tiny: adapter x ({missing}) cannot be served: adapter folder {missing} does not exist"
        in done.stderr
    )
