"""Real `python -m lmiserve serve` subprocesses serving the tiny random Llama, driven over HTTP.

Few servers, each started once per session and shared through `server_pool` (tests/conftest.py) with
every other test that asks for the same configuration (a start takes a few seconds):

- `server`: the default configuration plus ``max_input_len=64``;
- `tgi_server`: ``tgi_compat=true``;
- `jsonlines_server`: ``output_formatter=jsonlines`` (and chunked prefill:
  ``max_rolling_batch_prefill_tokens=4``);
- `dynamic_server`: ``rolling_batch=disable batch_size=4 max_batch_delay=50``;
- `lora_server`: the LoRA adapters ``alpha``, ``beta`` and ``gamma`` (`lora_adapter_dirs`), and
  `lora_dynamic_server`: the same under dynamic batching;
- `small_server`: ``max_rolling_batch_size=1 job_queue_size=1`` on `endless_model_dir`, a
  copy of the tiny model with a 2**20-token context, so that one request keeps the only slot busy
  until its client goes away (the tiny model decodes ~1000 tokens/s: such a request would run for
  many minutes; at the tiny model's 256-token context it is over in a fraction of a second, too
  short to tell a freed slot from a finished request);
- `impatient_server`: the same with ``predict_timeout=1.5``;
- `no_eos_server`: the default configuration on `unreachable_eos_model_dir` (every
  request makes exactly max_new_tokens tokens, for sampled requests that cannot send a seed).

Every fixture yields a `Server`: base URL, model name, an httpx client with a timeout on every call
and the parsing helpers the tests share (so no test module has to import from here).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.server import run_server
from helpers.server_pool import ServerPool
from helpers.tiny_model import ENDLESS_CONTEXT, with_context

DEFAULT_TIMEOUT = 30.0  # seconds; every call has a timeout so a hang fails fast
LONG_CONTEXT = 4096
PREDICT_TIMEOUT = 1.5  # impatient_server: seconds a request may wait for the slot


@dataclass
class Server:
    url: str
    name: str
    model_dir: Path
    client: httpx.Client = field(repr=False)

    # --- requests -------------------------------------------------------------------------------

    def post(
        self,
        payload: Any = None,
        *,
        path: str = "/invocations",
        content: bytes | str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        params: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST a JSON payload (or raw `content`); returns the whole response."""
        if content is None:
            content = json.dumps(payload)
            headers = {"content-type": "application/json", **(headers or {})}
        return self.client.post(path, content=content, headers=headers, timeout=timeout, params=params)

    def get(self, path: str, *, timeout: float = DEFAULT_TIMEOUT) -> httpx.Response:
        return self.client.get(path, timeout=timeout)

    def generate(self, inputs: str, **parameters: Any) -> dict:
        """Non-streaming request; asserts 200 and returns the body object."""
        response = self.post({"inputs": inputs, "parameters": parameters})
        assert response.status_code == 200, response.text
        return response.json()

    def stream(self, inputs: str, **parameters: Any) -> tuple[httpx.Response, list[dict]]:
        """``"stream": true`` request with the default (jsonlines) formatter; asserts 200."""
        response = self.post({"inputs": inputs, "parameters": parameters, "stream": True})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/jsonlines"
        return response, jsonlines(response.text)

    def new_client(self, **kwargs: Any) -> httpx.Client:
        """A client of its own (its own connections), e.g. to close one connection on purpose."""
        return httpx.Client(base_url=self.url, trust_env=False, **{"timeout": DEFAULT_TIMEOUT, **kwargs})

    # --- parsing, available to tests through any server fixture -----------------------------------

    jsonlines = staticmethod(lambda text: jsonlines(text))
    sse = staticmethod(lambda text: sse(text))


def jsonlines(text: str) -> list[dict]:
    """Parse a jsonlines body strictly: every line ends with "\\n", no empty line, one object each."""
    assert text.endswith("\n"), f"jsonlines body does not end with a newline: {text[-80:]!r}"
    lines = text[:-1].split("\n")
    assert all(lines), f"empty line in jsonlines body: {text!r}"
    out = []
    for line in lines:
        obj = json.loads(line)
        assert isinstance(obj, dict), line
        # LMI's byte format: json.dumps(obj, ensure_ascii=False) spacing and key order.
        assert line == json.dumps(obj, ensure_ascii=False), line
        out.append(obj)
    return out


def sse(text: str) -> list[dict]:
    """Parse a non-chat SSE body strictly: ``data: <json>\\n\\n`` events only, no [DONE]."""
    assert text.endswith("\n\n"), f"SSE body does not end with a blank line: {text[-80:]!r}"
    events = text[:-2].split("\n\n")
    out = []
    for event in events:
        assert event.startswith("data: "), f"not a data event: {event!r}"
        data = event[len("data: ") :]
        assert "\n" not in data, f"multi-line event: {event!r}"
        assert data != "[DONE]", "non-chat SSE must not end with [DONE]"
        obj = json.loads(data)
        assert data == json.dumps(obj, ensure_ascii=False), data
        out.append(obj)
    return out


def _start(model_dir: Path, *options: str, pool: ServerPool | None = None) -> Iterator[Server]:
    """A `Server` on `model_dir` with `options`: the session's shared one from `pool`, else one of its own."""
    args = ["--model-id", str(model_dir)]
    for option in options:
        args += ["-o", option]
    with contextlib.ExitStack() as stack:
        url = pool.url(args) if pool is not None else stack.enter_context(run_server(args))
        client = stack.enter_context(httpx.Client(base_url=url, timeout=DEFAULT_TIMEOUT, trust_env=False))
        yield Server(url=url, name=model_dir.name, model_dir=model_dir, client=client)


@pytest.fixture(scope="session")
def server(server_pool: ServerPool, tiny_model_dir: Path) -> Iterator[Server]:
    """Default configuration; prompts are limited to 64 tokens."""
    yield from _start(tiny_model_dir, "max_input_len=64", pool=server_pool)


@pytest.fixture(scope="session")
def lora_server(server_pool: ServerPool, tiny_model_dir: Path, lora_modules_option: str) -> Iterator[Server]:
    """The tiny model serving the LoRA adapters ``alpha``, ``beta`` and ``gamma`` (`lora_adapter_dirs`),
    registered at start through `lora_modules`. Shared: tests must not register or unregister adapters
    on it (start a server of their own for that)."""
    yield from _start(tiny_model_dir, f"lora_modules={lora_modules_option}", pool=server_pool)


@pytest.fixture(scope="session")
def lora_dynamic_server(server_pool: ServerPool, tiny_model_dir: Path, lora_modules_option: str) -> Iterator[Server]:
    """`lora_server` under dynamic batching (``rolling_batch=disable``): LMI's list of inputs, each with
    its own adapter (``adapters``: one name per input). Shared, as `lora_server`."""
    yield from _start(
        tiny_model_dir,
        f"lora_modules={lora_modules_option}",
        "rolling_batch=disable",
        "batch_size=4",
        "max_batch_delay=50",
        pool=server_pool,
    )


@pytest.fixture(scope="session")
def tgi_server(server_pool: ServerPool, tiny_model_dir: Path) -> Iterator[Server]:
    yield from _start(tiny_model_dir, "tgi_compat=true", pool=server_pool)


@pytest.fixture(scope="session")
def jsonlines_server(server_pool: ServerPool, tiny_model_dir: Path) -> Iterator[Server]:
    yield from _start(
        tiny_model_dir, "output_formatter=jsonlines", "max_rolling_batch_prefill_tokens=4", pool=server_pool
    )


@pytest.fixture(scope="session")
def dynamic_server(server_pool: ServerPool, tiny_model_dir: Path) -> Iterator[Server]:
    yield from _start(tiny_model_dir, "rolling_batch=disable", "batch_size=4", "max_batch_delay=50", pool=server_pool)


@pytest.fixture(scope="session")
def long_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 4096-token context (Llama's rotary positions need no new weights)."""
    return with_context(tiny_model_dir, tmp_path_factory.mktemp("long") / "tiny-long", LONG_CONTEXT)


ONE_SLOT = ("max_rolling_batch_size=1", "job_queue_size=1", f"max_new_tokens_limit={ENDLESS_CONTEXT}")


@pytest.fixture(scope="session")
def small_server(server_pool: ServerPool, endless_model_dir: Path) -> Iterator[Server]:
    """One batch slot, one queue place: admission, queue-full and cancellation are observable. A queued
    request waits as long as it has to (predict_timeout 120 s, longer than any test)."""
    yield from _start(endless_model_dir, *ONE_SLOT, pool=server_pool)


@pytest.fixture(scope="session")
def impatient_server(server_pool: ServerPool, endless_model_dir: Path) -> Iterator[Server]:
    """`small_server` whose queued requests fail after PREDICT_TIMEOUT seconds."""
    yield from _start(endless_model_dir, *ONE_SLOT, f"predict_timeout={PREDICT_TIMEOUT}", pool=server_pool)


@pytest.fixture(scope="session")
def no_eos_server(server_pool: ServerPool, unreachable_eos_model_dir: Path) -> Iterator[Server]:
    """The default configuration on a model that can never generate its EOS token."""
    yield from _start(unreachable_eos_model_dir, pool=server_pool)


# ---- tensor protocols: one-shot models on real servers (tests/helpers/tensor_models.py) ---------------


def _start_named(model_dir: Path, name: str, *options: str, pool: ServerPool) -> Iterator[Server]:
    """`--model-dir` (so the directory's serving.properties is read) with a fixed model name."""
    args = ["--model-dir", str(model_dir), "-o", f"model_name={name}"]
    for option in options:
        args += ["-o", option]
    url = pool.url(args)
    with httpx.Client(base_url=url, timeout=DEFAULT_TIMEOUT, trust_env=False) as client:
        yield Server(url=url, name=name, model_dir=model_dir, client=client)


@pytest.fixture(scope="session")
def affine_server(server_pool: ServerPool, torchscript_dir: Path) -> Iterator[Server]:
    """The scripted affine module: x FP32 [-1, 4] -> y FP32 [-1, 2], best INT64 [-1]."""
    yield from _start_named(torchscript_dir, "affine", pool=server_pool)


@pytest.fixture(scope="session")
def minilm_server(server_pool: ServerPool, minilm_dir: Path) -> Iterator[Server]:
    """all-MiniLM-L6-v2: text BYTES [-1] -> embedding FP32 [-1, 384]."""
    yield from _start_named(minilm_dir, "minilm", pool=server_pool)


# ---- embeddings, rerank and score: a store of tiny text encoders (tests/helpers/tensor_models.py) -------

EMBED, CLS, LAST, RERANK = "tiny-embed", "tiny-cls", "tiny-last", "tiny-rerank"


@pytest.fixture(scope="session")
def text_encoder_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random text encoders by model name: `tiny-embed` (mean pooling + Normalize, Matryoshka
    dimensions 8 and 16, a ``query`` prompt), `tiny-cls` (CLS pooling, not normalised, no Matryoshka),
    `tiny-last` (last-token pooling + Normalize) and `tiny-rerank` (a one-label CrossEncoder)."""
    from helpers.tensor_models import TINY_MATRYOSHKA, build_tiny_embedding_dir, build_tiny_reranker_dir

    root = tmp_path_factory.mktemp("text-encoders")
    return {
        EMBED: build_tiny_embedding_dir(root / EMBED, matryoshka=TINY_MATRYOSHKA, prompts={"query": "query: "}),
        CLS: build_tiny_embedding_dir(root / CLS, pooling="cls", normalize=False, seed=6),
        LAST: build_tiny_embedding_dir(root / LAST, pooling="lasttoken", seed=8),
        RERANK: build_tiny_reranker_dir(root / RERANK),
    }


def _store_server(root: Path, models: dict[str, Path], pool: ServerPool) -> Iterator[Server]:
    """A model store holding links to `models` (by name), served with a short batch delay."""
    root.mkdir(parents=True, exist_ok=True)
    for name, path in models.items():
        if not (root / name).exists():
            (root / name).symlink_to(path, target_is_directory=True)
    url = pool.url(["--model-store", str(root), "-o", "max_batch_delay=5", "-o", "batch_size=8"])
    with httpx.Client(base_url=url, timeout=DEFAULT_TIMEOUT, trust_env=False) as client:
        yield Server(url=url, name=EMBED, model_dir=root, client=client)


@pytest.fixture(scope="session")
def encoder_server(
    server_pool: ServerPool, tiny_model_dir: Path, text_encoder_dirs: dict[str, Path], tmp_path_factory
) -> Iterator[Server]:
    """A store: the tiny LLM (`tiny`), three embedding models and a reranker (`text_encoder_dirs`)."""
    yield from _store_server(
        tmp_path_factory.mktemp("encoder-store"), {"tiny": tiny_model_dir, **text_encoder_dirs}, server_pool
    )


@pytest.fixture(scope="session")
def tei_server(server_pool: ServerPool, text_encoder_dirs: dict[str, Path], tmp_path_factory) -> Iterator[Server]:
    """A store with one embedding model (`tiny-embed`) and one reranker, as TEI's routes need."""
    models = {name: text_encoder_dirs[name] for name in (EMBED, RERANK)}
    yield from _store_server(tmp_path_factory.mktemp("tei-store"), models, server_pool)
