"""KServe's Python SDK (`InferenceRESTClient`, protocol v2), unmodified, reads lmiserve's V2 health answers:
`is_server_live` / `is_server_ready` return the bodies' `live` / `ready` (an empty body, lmiserve's answer
before, made them raise), `is_model_ready` the status. kserve lives in .venv-kserve
(`make install-kserve`); tests/helpers/kserve_client.py runs there as a subprocess. The bodies
themselves, not-ready answers included, are checked byte for byte in tests/unit/test_v2_http.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # the slowest tier: KServe's client runs in its own venv

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-kserve" / "bin" / "python"
SCRIPT = REPO / "tests" / "helpers" / "kserve_client.py"


def test_kserve_rest_client_health(affine_server):
    if not PYTHON.is_file():
        raise RuntimeError(f"{PYTHON} is missing: run `make install-kserve`")
    done = subprocess.run(
        [str(PYTHON), str(SCRIPT), affine_server.url, "affine"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"live": True, "ready": True, "model_ready": True, "unknown_model_ready": False}
