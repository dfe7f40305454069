"""The documentation's curl examples run as pasted, against the server each block names.

The pages are README.md, every docs/**/*.md and the root files the docs site includes (SECURITY.md,
CONTRIBUTING.md, ...: `helpers.doc_examples.doc_pages`). Every fenced shell block with a curl command
has a marker right above it, `<!-- server: KIND -->` (invisible on GitHub and in the site); `SERVERS`
below starts each kind the way the pages say, after running the pages' `<!-- setup: KIND -->` blocks in
a temporary directory. The test rewrites `localhost:8080` to the test server's port, runs every command
with bash and the real curl, and checks the exit code, the HTTP status (below 400, or the one a
`# expect NNN` comment asks for) and that the output the page shows has the shape and keys of the real
answer (`helpers/doc_examples.py`). A failure names the page and line: `docs/protocols/tgi.md:51: curl ...`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.doc_examples import (
    Example,
    Outcome,
    doc_pages,
    mismatches,
    parse_examples,
    parse_setups,
    run_bash,
    run_example,
)
from helpers.server import REPO_ROOT, free_port, run_server

PAGES = {page: (REPO_ROOT / page).read_text(encoding="utf-8") for page in doc_pages(REPO_ROOT)}
EXAMPLES = [example for page, text in PAGES.items() for example in parse_examples(text, page)]
CURL_EXAMPLES = [example for example in EXAMPLES if example.is_curl]
SETUPS = [setup for page, text in PAGES.items() for setup in parse_setups(text, page)]
# The README held this many curl examples before they moved into the guides: the pages may add
# examples, never lose them.
MIN_CURL_EXAMPLES = 73


@dataclass
class Server:
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    replacements: dict[str, str] = field(default_factory=dict)  # the pages' text -> what this machine has


def _make_serve(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    request.getfixturevalue("smollm_dir")  # converts the bundled model once, outside the startup timeout
    return Server()


def _dynamic_batch(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    request.getfixturevalue("smollm_dir")
    return Server(["-o", "rolling_batch=disable", "-o", "batch_size=4", "-o", "max_batch_delay=50"])


def _api_key(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    request.getfixturevalue("smollm_dir")
    return Server(["--api-key", "s3cret"])


def _store(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    """The docs' model store (its setup blocks, docs/models.md, made `store/` with the bundled SmolLM2 as `smollm2` and
    all-MiniLM-L6-v2 as `minilm`, and the TorchScript model in `/tmp/demo/affine`), started as its
    start line says."""
    request.getfixturevalue("smollm_dir")
    demo = tmp_path / "demo"
    return Server(
        ["--model-store", str(tmp_path / "store"), "-o", f"allowed_model_paths={demo}"],
        env={
            "AIP_PREDICT_ROUTE": "/vertex/predict",
            "AIP_HEALTH_ROUTE": "/vertex/health",
            "AIP_DEPLOYED_MODEL_ID": "1234",
        },
        replacements={"/tmp/demo": str(demo)},
    )


def _metrics_port(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    """`make serve`'s model with `--metrics-port`: the page's 9090 becomes a free port."""
    request.getfixturevalue("smollm_dir")
    port = free_port()
    return Server(["--metrics-port", str(port)], replacements={"localhost:9090": f"127.0.0.1:{port}"})


def _embeddings(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    """docs/protocols/embeddings.md's store (its setup block): all-MiniLM-L6-v2 as `minilm` and a demo
    reranker, started as the page says."""
    return Server(["--model-store", str(tmp_path / "embed-store")])


def _speculative(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    """docs/speculative-decoding.md's server: the bundled model with prompt lookup (the same server as
    tests/e2e/test_speculative_bundled.py's, shared through the pool)."""
    request.getfixturevalue("smollm_dir")
    return Server(["-o", SPECULATIVE_CONFIG])


SPECULATIVE_CONFIG = 'speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def _lora(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    """docs/lora.md's server: the bundled model with the adapters its setup block makes in /tmp/adapters
    (here under `tmp_path`), `sql` and `chat` named at start, the folder allowed for runtime registration."""
    request.getfixturevalue("smollm_dir")
    adapters = tmp_path / "adapters"
    return Server(
        ["-o", f"lora_modules=sql={adapters}/sql,chat={adapters}/chat", "-o", f"allowed_model_paths={adapters}"],
        replacements={"/tmp/adapters": str(adapters)},
    )


def _vision(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    """docs/vision.md's server: a tiny random Idefics3 (SmolVLM's architecture, processor and chat
    template; tests/helpers/tiny_vlm.py) in place of the page's SmolVLM-256M-Instruct, served under the
    page's name."""
    from helpers.tiny_vlm import build_tiny_vlm_dir

    model = build_tiny_vlm_dir("idefics3", tmp_path / "SmolVLM-256M-Instruct")
    return Server(["--model-id", str(model), "-o", "model_name=smolvlm"])


SERVERS: dict[str, Callable[[pytest.FixtureRequest, Path], Server]] = {
    "make serve": _make_serve,
    "speculative": _speculative,
    "dynamic-batch": _dynamic_batch,
    "api-key": _api_key,
    "store": _store,
    "metrics-port": _metrics_port,
    "embeddings": _embeddings,
    "lora": _lora,
    "vision": _vision,
}
# How the pages tell a reader to start each kind; `SERVERS` starts the same. Every page that holds
# examples of a kind shows its start command.
START_COMMANDS = {
    "make serve": "make serve ",
    "speculative": f".venv/bin/lmiserve serve -o '{SPECULATIVE_CONFIG}'\n",
    "dynamic-batch": ".venv/bin/lmiserve serve -o rolling_batch=disable -o batch_size=4 -o max_batch_delay=50\n",
    "api-key": "lmiserve serve --api-key s3cret ",
    "metrics-port": "lmiserve serve --metrics-port 9090\n",
    "embeddings": ".venv/bin/lmiserve serve --model-store embed-store\n",
    "lora": ".venv/bin/lmiserve serve -o lora_modules=sql=/tmp/adapters/sql,chat=/tmp/adapters/chat "
    "-o allowed_model_paths=/tmp/adapters\n",
    "vision": ".venv/bin/lmiserve serve --model-id HuggingFaceTB/SmolVLM-256M-Instruct -o model_name=smolvlm\n",
    "store": "AIP_PREDICT_ROUTE=/vertex/predict AIP_HEALTH_ROUTE=/vertex/health AIP_DEPLOYED_MODEL_ID=1234 \\\n"
    "  .venv/bin/lmiserve serve --model-store store -o allowed_model_paths=/tmp/demo\n",
}


def test_every_curl_example_names_a_known_server():
    assert len(CURL_EXAMPLES) >= MIN_CURL_EXAMPLES, (
        f"{len(CURL_EXAMPLES)} curl examples found in {sorted(PAGES)}, expected at least {MIN_CURL_EXAMPLES}"
    )
    unmarked = [str(example) for example in CURL_EXAMPLES if example.server not in SERVERS]
    assert not unmarked, (
        f"put one of {sorted(SERVERS)} as `<!-- server: KIND -->` right above these blocks:\n" + "\n".join(unmarked)
    )
    unknown = [f"{setup}: {setup.server}" for setup in SETUPS if setup.server not in SERVERS]
    assert not unknown, f"setup blocks for a server kind not in {sorted(SERVERS)}:\n" + "\n".join(unknown)


@pytest.mark.parametrize("kind", list(SERVERS))
def test_the_docs_say_how_to_start_each_server(kind: str):
    pages = sorted({example.file for example in CURL_EXAMPLES if example.server == kind})
    assert pages, f"no example is marked `<!-- server: {kind} -->`"
    missing = [page for page in pages if START_COMMANDS[kind] not in PAGES[page]]
    assert not missing, (
        f"these pages hold `{kind}` examples but do not start it with {START_COMMANDS[kind]!r}: {missing}; "
        "show the start command there, or update SERVERS and START_COMMANDS"
    )


def _report(example: Example, outcome: Outcome, problems: list[str]) -> str:
    return "\n".join(
        [
            str(example),
            *(f"  - {problem}" for problem in problems),
            f"  exit code {outcome.exit_code}, HTTP {outcome.status}",
            "  stdout: " + outcome.stdout[:2000],
            "  stderr: "
            + "\n".join(line for line in outcome.stderr.splitlines() if not line.startswith(("*", ">", "<", "{", "}")))[
                :1000
            ],
        ]
    )


@pytest.mark.e2e
@pytest.mark.parametrize("kind", list(SERVERS))
def test_doc_examples_run_as_pasted(kind: str, request: pytest.FixtureRequest, tmp_path: Path, server_pool):
    examples = [example for example in CURL_EXAMPLES if example.server == kind]
    assert examples, f"no example is marked `<!-- server: {kind} -->`"
    if shutil.which("curl") is None or shutil.which("bash") is None:
        pytest.fail("the doc examples need curl and bash on PATH (Debian: apt-get install curl)")
    server = SERVERS[kind](request, tmp_path)
    replacements = {".venv/bin/": f"{Path(sys.executable).parent}/", **server.replacements}
    for setup in (setup for setup in SETUPS if setup.server == kind):
        done = run_bash(setup.script, replacements, cwd=tmp_path)
        assert done.exit_code == 0, f"{setup}: the setup block failed:\n{done.stderr}"
    failures: list[str] = []
    with contextlib.ExitStack() as stack:
        if kind in ("make serve", "speculative"):  # servers the other e2e modules share
            url = server_pool.url(server.args, env=server.env, timeout=300)
        else:
            url = stack.enter_context(run_server(server.args, env=server.env, timeout=300))
        replacements["localhost:8080"] = url.removeprefix("http://")
        for example in examples:
            started = time.monotonic()
            outcome = run_example(example, replacements, cwd=tmp_path)
            took = time.monotonic() - started
            problems = mismatches(example, outcome)
            if outcome.exit_code != 0:
                problems.append(f"exit code {outcome.exit_code}")
            if example.expect is not None and outcome.status != example.expect:
                problems.append(f"expected HTTP {example.expect} (`# expect`), got {outcome.status}")
            if example.expect is None and (outcome.status is None or outcome.status >= 400):
                problems.append(f"HTTP {outcome.status}; mark an error shown on purpose with `# expect NNN`")
            print(
                json.dumps(
                    {
                        "at": f"{example.file}:{example.line}",
                        "s": round(took, 1),
                        "status": outcome.status,
                        "stdout": outcome.stdout[:600],
                    }
                )
            )
            if problems:
                failures.append(_report(example, outcome, problems))
    assert not failures, f"{len(failures)} of {len(examples)} doc examples failed:\n\n" + "\n\n".join(failures)
