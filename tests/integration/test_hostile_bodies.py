"""Hostile bodies on every POST/PUT route of the route table, on real servers: never a 5xx, never a hang,
never a Python internal in the answer.

Three servers: `llm` (the tiny LLM alone, TGI-compatible /invocations, Vertex AI routes from the
environment), `store` (a model store: the tiny LLM, a TorchScript one-shot model, a tiny embedding
model and a tiny reranker, so the embedding, rerank and score routes reach their models) and `vlm` (a
tiny Qwen2-VL: every route that takes images gets hostile images -- corrupt, truncated, SVG, a
decompression bomb, URLs it must not fetch, too many -- and image-bearing bodies mutated at random). The targets
are every POST/PUT route of `lmiserve.server.app.routes` (Mounts walked), path parameters filled with
the served model names and with names that are not served. Each target gets
- the known pitfalls (hand-written): 10,000-level nesting, lone surrogates, NaN/Infinity, huge
  integers, an empty body, binary garbage under a JSON content type, wrong content types;
- hypothesis' bodies: random JSON, protocol bodies with one field replaced by a random value,
  truncated bodies, nested bodies, JSON Lines, CSV, binary, a few MB, under every content type
  (JSON, JSON Lines, CSV, text/plain, octet-stream with V2's Inference-Header-Content-Length, garbage).
Every answer must be a 2xx or a 4xx, arrive within the client's timeout, and hold no traceback.
The examples are derandomized and no example database is kept, so a run is reproducible.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.routing import BaseRoute, Mount, Route

from helpers.server import run_server
from helpers.tensor_models import build_tiny_embedding_dir, build_tiny_reranker_dir, build_torchscript_dir
from lmiserve.config import Settings
from lmiserve.server.app import routes as app_routes

TIMEOUT = 60.0  # seconds for one answer: a hang fails the test
# every generation is short (TGI's POST / without max_new_tokens would fill the context)
SHORT = [
    "-o",
    "max_new_tokens=4",
    "-o",
    "max_new_tokens_limit=16",
    "-o",
    "max_input_tokens=32",
    "-o",
    "max_total_tokens=40",
]
VERTEX_ENV = {"AIP_PREDICT_ROUTE": "/vertex/predict", "AIP_HEALTH_ROUTE": "/vertex/health", "AIP_MODE": "PREDICTION"}
INTERNALS = re.compile(r"Traceback|RecursionError|maximum recursion|File \"|\b[A-Z][A-Za-z]*Error\(|<module ")
SWEEP = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@dataclass(frozen=True)
class Target:
    method: str
    path: str
    route: str  # the route's path template


@dataclass
class Served:
    client: httpx.Client
    targets: list[Target]
    models: list[str]


# ---- the route table -------------------------------------------------------------------------------


def walk(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, set[str]]]:
    """(path template, methods) of every route, Mounts included."""
    for route in routes:
        if isinstance(route, Mount):
            yield from walk(list(route.routes), prefix + route.path)
        elif isinstance(route, Route):
            yield prefix + route.path, set(route.methods or ())


def fillings(name: str, models: list[str]) -> list[str]:
    names = [*models, "nope"]
    if name in ("model_name", "model"):
        return names
    if name == "version":
        return ["1"]
    if name == "rest":  # TF Serving's /v1/models/{rest}
        return [
            *(f"{m}:predict" for m in names),
            f"{models[0]}:classify",
            f"{models[0]}:regress",
            f"{models[0]}/versions/1:predict",
            f"{models[0]}/labels/x:predict",
            f"{models[0]}:explain",
        ]
    if name == "path":  # V2's catch-all under /v2
        return ["models/nope/infer", "junk"]
    if name == "endpoint":
        return ["1"]
    if name == "deployed":
        return ["2:predict", "2"]
    if name == "response_id":  # OpenAI's stored responses (GET/DELETE only: never a target)
        return ["resp_1"]
    if name == "adapter_name":  # LoRA adapters (POST .../{adapter_name}/update); none is served here
        return ["nope"]
    raise AssertionError(f"no filling for path parameter {name!r}: add one")


def targets(models: list[str], **options: Any) -> list[Target]:
    """Every POST/PUT route of the app's table, its path parameters filled."""
    found = []
    for template, methods in walk(app_routes(Settings(**options))):
        params = re.findall(r"{(\w+)(?::\w+)?}", template)
        for values in itertools.product(*(fillings(p, models) for p in params)):
            path = template
            for param, value in zip(params, values):
                path = re.sub(r"{" + param + r"(?::\w+)?}", value, path, count=1)
            found.extend(Target(m, path, template) for m in sorted(methods & {"POST", "PUT"}))
    return found


# ---- servers -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[Served]:
    options = ["-o", "model_name=tiny", "-o", "tgi_compat=true", *SHORT]
    with run_server(["--model-id", str(tiny_model_dir), *options], env=VERTEX_ENV) as url:
        with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as client:
            route_targets = targets(["tiny"], vertex_predict_route="/vertex/predict")
            yield Served(client, route_targets, ["tiny"])


@pytest.fixture(scope="module")
def store(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("hostile-store")
    shutil.copytree(tiny_model_dir, root / "tiny-llm")
    build_torchscript_dir(root / "affine")
    build_tiny_embedding_dir(root / "embed", matryoshka=[8, 16])
    build_tiny_reranker_dir(root / "rerank")
    models = ["affine", "embed", "rerank", "tiny-llm"]
    with run_server(["--model-store", str(root), "-o", "max_batch_delay=5", *SHORT]) as url:
        with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as client:
            yield Served(client, targets(models), models)


def post(served: Served, target: Target, body: bytes, headers: dict[str, str]) -> None:
    """Send the body; the answer must come within TIMEOUT, be a 2xx or 4xx and hold no Python internals."""
    what = f"{target.method} {target.path} {headers} {body[:200]!r}"
    try:
        response = served.client.request(target.method, target.path, content=body, headers=headers, timeout=TIMEOUT)
    except httpx.TimeoutException:
        pytest.fail(f"{what}: no answer within {TIMEOUT} s")
    check(response, what)


def check(response: httpx.Response, what: str) -> None:
    assert response.status_code < 500, f"{what} -> {response.status_code} {response.text[:500]}"
    assert response.status_code >= 200, f"{what} -> {response.status_code}"
    found = INTERNALS.search(response.text)
    assert found is None, (
        f"{what} -> {response.status_code}: Python internals {found.group(0)!r} in {response.text[:500]}"
    )


# ---- bodies ------------------------------------------------------------------------------------------

TGI_PARAMETERS = {
    "max_new_tokens": 3,
    "temperature": 0.7,
    "top_k": 5,
    "top_p": 0.9,
    "typical_p": 0.9,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.1,
    "do_sample": True,
    "seed": 7,
    "stop": ["x"],
    "details": True,
    "decoder_input_details": True,
    "return_full_text": True,
    "top_n_tokens": 2,
    "truncate": 8,
    "best_of": 1,
    "watermark": False,
}
CHAT = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
    ],
    "max_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "stop": ["x"],
    "seed": 1,
    "logprobs": True,
    "top_logprobs": 2,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.1,
    "stream": False,
    "stream_options": None,  # an object without `stream` is a 400 before anything else (vLLM's rule)
}
COMPLETION = {
    "prompt": ["Hi", "Yo"],
    "max_tokens": 2,
    "echo": True,
    "logprobs": 2,
    "best_of": 1,
    "n": 1,
    "stream": False,
}
RESPONSES = {
    "model": "tiny",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ],
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
    "tool_choice": "auto",
    "text": {"format": {"type": "text"}},
    "max_output_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "stream": False,
    "store": True,
}
LMI = {"inputs": "Hello", "parameters": {**TGI_PARAMETERS, "output_formatter": "jsonlines"}, "stream": False}
V2_INFER = [
    {
        "id": "1",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4], "parameters": {}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": False}}],
        "parameters": {"binary_data_output": False},
    },
    {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}],
        "parameters": {"max_new_tokens": 2, "content_type": "str"},
    },
]
V2_GENERATE = {"text_input": "Hi", "parameters": {"max_new_tokens": 2, "stop": ["a"], "temperature": 0.5}, "id": "7"}
TF_SERVING = [
    {"instances": [[1.0, 2.0, 3.0, 4.0]], "signature_name": "serving_default"},
    {"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}},
    {"examples": [{"x": [1.0, 2.0, 3.0, 4.0]}], "context": {}},
    {"instances": [{"b64": "SGk="}, "Hi"], "parameters": {"max_new_tokens": 2}},
]
ANTHROPIC = {
    "model": "tiny",
    "max_tokens": 2,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image", "source": {"type": "url"}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
    ],
    "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "stop_sequences": ["x"],
    "temperature": 0.5,
    "top_k": 3,
    "stream": False,
    "thinking": {"type": "disabled"},
}
VERTEX = {"instances": ["Hi", {"prompt": "Yo"}], "parameters": {"max_new_tokens": 2}}
EMBEDDINGS = [
    {"model": "embed", "input": ["Hi", "Yo"], "encoding_format": "base64", "dimensions": 8, "user": "u"},
    {"input": [[9906, 1917], [15339]], "encoding_format": "float"},
]
TEI_EMBED = {"inputs": ["Hi", "Yo"], "normalize": False, "truncate": True, "truncation_direction": "Left"}
TEI_RERANK = {"query": "Hi", "texts": ["a", "b"], "raw_scores": True, "return_text": True, "truncate": True}
RERANK = {"model": "rerank", "query": "Hi", "documents": ["a", {"text": "b"}], "top_n": 1, "return_documents": True}
SCORE = [{"model": "rerank", "text_1": "Hi", "text_2": ["a", "b"]}, {"text_1": ["a", "b"], "text_2": ["c", "d"]}]
MANAGEMENT = {"url": "/nonexistent/model", "model_name": "m", "synchronous": "true", "batch_size": 2}
FAMILIES: dict[str, list[Any]] = {
    "invocations": [LMI, CHAT, COMPLETION, {"inputs": ["Hi", "Yo"]}, *TF_SERVING],
    "tgi": [{"inputs": "Hi", "parameters": TGI_PARAMETERS, "stream": False}],
    "chat": [CHAT],
    "completion": [COMPLETION],
    "responses": [RESPONSES],
    "v2_infer": V2_INFER,
    "v2_generate": [V2_GENERATE],
    "tfserving": TF_SERVING,
    "vertex": [VERTEX],
    "anthropic": [ANTHROPIC, {k: v for k, v in ANTHROPIC.items() if k not in ("max_tokens", "stop_sequences")}],
    "management": [MANAGEMENT],
    "index": [{"ready": True}],
    "embeddings": EMBEDDINGS,
    "tei_embed": [TEI_EMBED],
    "tei_rerank": [TEI_RERANK],
    "rerank": [RERANK],
    "score": SCORE,
}
TEMPLATES: list[Any] = [t for family in FAMILIES.values() for t in family]


def family(route: str) -> list[Any]:
    """The bodies a route takes (every template for a route no family names)."""
    for key, name in [
        ("/v1/messages", "anthropic"),
        ("/v1/chat/completions", "chat"),
        ("/chat_tokenize", "chat"),
        ("/v1/completions", "completion"),
        ("/v1/responses", "responses"),
        ("/infer", "v2_infer"),
        ("/generate", "v2_generate" if route.startswith("/v2") else "tgi"),
        ("/tokenize", "tgi"),
        ("/repository/index", "index"),
        ("/v1/models", "tfserving"),
        ("/vertex", "vertex"),
        ("/v1/endpoints", "vertex"),
        ("/invocations", "invocations"),
        ("/predictions", "invocations"),
        ("/invoke", "invocations"),
        ("/v1/embeddings", "embeddings"),
        ("/embed", "tei_embed"),
        ("/v1/rerank", "rerank"),
        ("/v2/rerank", "rerank"),
        ("/rerank", "tei_rerank"),
        ("/score", "score"),
    ]:
        if key in route:
            return FAMILIES[name]
    if route == "/":
        return FAMILIES["tgi"]
    if route == "/models":
        return FAMILIES["management"]
    return TEMPLATES


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["\ud800", "a\udfffb", "\x00", "😀", "{{ x }}", "<|eot_id|>", "-1", "1e309"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8")


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys / indexes) into a JSON value."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths(item, (*prefix, index))
    return found


def replaced(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(copy[path[0]], path[1:], new)
    return copy


def nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "[" else '{"a":' * depth + "1" + "}" * depth


@st.composite
def mutated(draw: st.DrawFn, templates: list[Any]) -> bytes:
    """A body the route takes with one value (or the whole body) replaced by a random JSON value."""
    template = draw(st.sampled_from(templates))
    path = draw(st.sampled_from(paths(template)))
    return dumps(replaced(template, path, draw(json_values)))


@st.composite
def deeply_nested(draw: st.DrawFn, templates: list[Any]) -> bytes:
    depth = draw(st.sampled_from([63, 64, 65, 100, 999, 1001, 5000, 20_000]))
    inner = nested(depth, draw(st.sampled_from("[{")))
    template = draw(st.sampled_from(templates))
    path = draw(st.sampled_from(paths(template)))
    return dumps(replaced(template, path, "@@")).replace(b'"@@"', inner.encode())


@st.composite
def truncated(draw: st.DrawFn, templates: list[Any]) -> bytes:
    body = dumps(draw(st.sampled_from(templates)))
    return body[: draw(st.integers(0, len(body) - 1))]


@st.composite
def json_lines(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(st.sampled_from(TEMPLATES).map(dumps) | json_values.map(dumps), min_size=1, max_size=3))
    return b"\n".join(lines)


csv_bodies = st.lists(
    st.lists(st.sampled_from(["1", "2.5", "", "nan", "x", '"a,b"', '"', "\ud800", "1e999"]), min_size=1, max_size=5),
    min_size=0,
    max_size=3,
).map(lambda rows: "\n".join(",".join(r) for r in rows).encode("utf-8", "surrogatepass"))

BIG = [
    dumps({"inputs": "word " * 400_000, "parameters": {"max_new_tokens": 1}}),
    dumps({"instances": [[0.5, 1.5, 2.5, 3.5]] * 100_000}),
    dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [100_000, 4], "data": [0.25] * 400_000}]}),
]


def bodies(route: str) -> st.SearchStrategy[bytes]:
    templates = family(route)
    return st.one_of(
        mutated(templates),
        mutated(TEMPLATES),
        json_values.map(dumps),
        truncated(templates),
        deeply_nested(templates),
        json_lines(),
        csv_bodies,
        st.binary(max_size=64),
        st.sampled_from(BIG),
    )


CONTENT_TYPES = [
    "application/json",
    "application/jsonlines",
    "text/csv",
    "text/csv; label_size=1",
    "text/plain",
    "application/octet-stream",
    "application/x-garbage",
    "application/json; charset=latin-1",
    "text/csv; charset=unicode_escape",
    None,
]


@st.composite
def headers(draw: st.DrawFn) -> dict[str, str]:
    found: dict[str, str] = {}
    ctype = draw(st.sampled_from(["application/json"]) | st.sampled_from(CONTENT_TYPES))
    if ctype is not None:
        found["content-type"] = ctype
    extra = draw(
        st.sampled_from(
            [
                {},
                {"Inference-Header-Content-Length": "10"},
                {"Inference-Header-Content-Length": "999999"},
                {"Inference-Header-Content-Length": "-1"},
                {"X-Amzn-SageMaker-Custom-Attributes": "tfs-model-name=nope"},
                {"X-Amzn-SageMaker-Custom-Attributes": "tfs-model-name=affine,tfs-method=classify"},
                {"model_name": "nope"},
                {"accept": "text/csv"},
                {"accept": "application/x-nothing"},
            ]
        )
    )
    return {**found, **extra}


# ---- the known pitfalls, on every target ---------------------------------------------------------------

PITFALLS: list[bytes] = [
    b"[" * 10_000 + b"]" * 10_000,
    b'{"inputs": ' + nested(10_000, "{").encode() + b"}",
    b'{"inputs": "\\ud800"}',
    b'{"inputs": "a\\udc00b", "parameters": {"max_new_tokens": 2}}',
    b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
    b'{"prompt": "\\udfff", "max_tokens": 2}',
    b'{"text_input": "\\ud800", "parameters": {"max_new_tokens": 2}}',
    b'{"instances": ["\\ud800"]}',
    b'{"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["\\ud800"]}]}',
    b'{"inputs": "Hi", "parameters": {"temperature": NaN, "top_p": Infinity, "max_new_tokens": -Infinity}}',
    b'{"inputs": "Hi", "parameters": {"max_new_tokens": 1' + b"0" * 4000 + b"}}",
    b'{"inputs": "Hi", "parameters": {"seed": 1' + b"0" * 5000 + b"}}",
    b'{"instances": [[NaN, Infinity, -Infinity, 1e999]]}',
    b"",
    b"\xff\xfe\x00garbage\x80",
    b"\xed\xa0\x80",
]


def test_every_post_route_is_swept(llm: Served, store: Served) -> None:
    """The route table has POST/PUT routes of every protocol, and the targets cover them."""
    paths_found = {t.path for t in llm.targets + store.targets}
    for expected in [
        "/invocations",
        "/predictions/tiny-llm",
        "/models/affine/invoke",
        "/models",
        "/generate",
        "/generate_stream",
        "/",
        "/tokenize",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v2/models/affine/infer",
        "/v2/models/tiny-llm/generate_stream",
        "/v2/repository/index",
        "/v1/models/affine:predict",
        "/v1/endpoints/1/deployedModels/2:predict",
        "/vertex/predict",
        "/v1/embeddings",
        "/embed",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/score",
        "/v1/score",
    ]:
        assert expected in paths_found


def representatives(targets: list[Target]) -> list[Target]:
    """One target per route and method: the first filling of its path parameters (a served model)."""
    seen: dict[tuple[str, str], Target] = {}
    for target in targets:
        seen.setdefault((target.method, target.route), target)
    return list(seen.values())


@pytest.mark.parametrize("which", ["llm", "store"])
def test_known_pitfalls_on_every_route(which: str, request: pytest.FixtureRequest) -> None:
    served: Served = request.getfixturevalue(which)
    for target in representatives(served.targets):
        for body in PITFALLS:
            post(served, target, body, {"content-type": "application/json"})
        for ctype in CONTENT_TYPES:
            post(served, target, b"\xff\x00garbage,{[", {"content-type": ctype} if ctype else {})
        for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/jsonlines"}):
            post(served, target, b'{"inputs": "Hi"}', headers)
    assert served.client.get("/ping").status_code == 200


@SWEEP
@given(data=st.data())
def test_random_bodies_llm(llm: Served, data: st.DataObject) -> None:
    sweep(llm, data)


@SWEEP
@given(data=st.data())
def test_random_bodies_store(store: Served, data: st.DataObject) -> None:
    sweep(store, data)


def sweep(served: Served, data: st.DataObject) -> None:
    route = data.draw(st.sampled_from(sorted({t.route for t in served.targets})), label="route")
    target = data.draw(st.sampled_from([t for t in served.targets if t.route == route]), label="target")
    body = data.draw(bodies(route), label="body")
    sent = data.draw(headers(), label="headers")
    post(served, target, body, sent)


# ---- a vision-language model: bodies with images, and hostile images (issue #40) ------------------------


def _image_bytes(kind: str) -> bytes:
    """A small real PNG (`png`), or a hostile image: corrupt, truncated, an SVG, a decompression bomb
    (a PNG that declares 400 million pixels), text."""
    import io

    from PIL import Image

    out = io.BytesIO()
    if kind == "bomb":
        Image.new("1", (20000, 20000)).save(out, format="PNG")
        return out.getvalue()
    Image.new("RGB", (24, 16), (200, 40, 10)).save(out, format="PNG")
    png = out.getvalue()
    return {
        "png": png,
        "corrupt": png[:16] + b"\x00garbage" * 8,
        "truncated": png[: len(png) // 2],
        "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>',
        "text": b"not an image",
    }[kind]


def vision_families(image: bytes, media_type: str = "image/png", url: str | None = None) -> dict[str, list[Any]]:
    """The bodies of every route that takes images, each carrying `image` (or the image at `url`)."""
    encoded = base64.b64encode(image).decode()
    url = url or f"data:{media_type};base64,{encoded}"
    chat = {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": url}}],
            }
        ],
        "max_tokens": 2,
    }
    source = (
        {"type": "base64", "media_type": media_type, "data": encoded}
        if url.startswith("data:")
        else {"type": "url", "url": url}
    )
    anthropic = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
    }
    text = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}
    image_input = {
        "name": "image",
        "datatype": "BYTES",
        "shape": [1],
        "data": [encoded if url.startswith("data:") else url],
    }
    return {
        "invocations": [chat],
        "chat": [chat],
        "anthropic": [anthropic],
        "responses": [
            {
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
                "max_output_tokens": 2,
            }
        ],
        "tgi": [{"inputs": f"![]({url}) Hi", "parameters": {"max_new_tokens": 2}}],
        "v2_infer": [{"inputs": [text, image_input], "parameters": {"max_new_tokens": 2}}],
        "v2_generate": [{"text_input": "Hi", "image": image_input["data"][0], "parameters": {"max_new_tokens": 2}}],
        "vertex": [
            {"instances": [{"prompt": "Hi", "image": image_input["data"][0]}], "parameters": {"max_new_tokens": 2}}
        ],
    }


def vision_family(route: str, families: dict[str, list[Any]]) -> list[Any] | None:
    """The image-bearing bodies of `route` (None: it takes no images)."""
    for templates in FAMILIES.values():
        if family(route) is templates:
            name = next(k for k, v in FAMILIES.items() if v is templates)
            return families.get(name)
    return None


VISION_LIMITS = ["-o", "max_new_tokens=4", "-o", "max_input_tokens=256", "-o", "max_total_tokens=264"]


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir) -> Iterator[Served]:
    options = ["-o", "model_name=tiny", "-o", "tgi_compat=true", "-o", "limit_mm_per_prompt=2", *VISION_LIMITS]
    args = ["--model-id", str(tiny_vlm_dir("qwen2_vl")), "--grpc-port", "0", *options]
    with run_server(args, env=VERTEX_ENV, timeout=300) as url:
        with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as client:
            found = targets(["tiny"], vertex_predict_route="/vertex/predict")
            taking = [t for t in found if vision_family(t.route, vision_families(b"")) is not None]
            yield Served(client, taking, ["tiny"])


HOSTILE_IMAGES = ["corrupt", "truncated", "svg", "bomb", "text"]
HOSTILE_URLS = ["http://127.0.0.1:1/a.png", "http://169.254.169.254/latest", "file:///etc/passwd", "data:,x"]


def test_hostile_images_on_every_route_that_takes_images(vlm: Served) -> None:
    """Each hostile image (and URL the server must not fetch, and one image too many) on every route that
    takes images: a 4xx (TGI's stream: its in-band validation error), never a 5xx, no internals."""
    routes = {t.route for t in vlm.targets}
    for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/generate", "/invocations", "/tokenize"):
        assert route in routes, route
    assert {"/v2/models/{model}/infer", "/v2/models/{model}/generate", "/vertex/predict"} <= routes
    cases = [vision_families(_image_bytes(k), "image/svg+xml" if k == "svg" else "image/png") for k in HOSTILE_IMAGES]
    cases += [vision_families(b"", url=url) for url in HOSTILE_URLS]
    for target in representatives(vlm.targets):
        for families in cases:
            for body in vision_family(target.route, families) or []:
                what = f"{target.method} {target.path} {dumps(body)[:200]!r}"
                response = vlm.client.request(
                    target.method, target.path, content=dumps(body), headers={"content-type": "application/json"}
                )
                check(response, what)
                refused = response.status_code >= 400 or '"error"' in response.text
                assert refused, f"{what} -> {response.status_code} {response.text[:300]}"
    chat = vision_families(_image_bytes("png"))["chat"][0]
    parts = chat["messages"][0]["content"]
    too_many = {**chat, "messages": [{"role": "user", "content": parts + [parts[1]] * 2}]}
    response = vlm.client.post("/v1/chat/completions", json=too_many)
    assert response.status_code == 400 and "limit_mm_per_prompt" in response.text, response.text
    assert vlm.client.get("/ping").status_code == 200


@st.composite
def vision_bodies(draw: st.DrawFn, route: str) -> bytes:
    templates = vision_family(route, vision_families(_image_bytes("png"))) or TEMPLATES
    return draw(st.one_of(mutated(templates), truncated(templates), deeply_nested(templates)))


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_random_bodies_with_images(vlm: Served, data: st.DataObject) -> None:
    """Image-bearing bodies with one value replaced by a random one, truncated or deeply nested."""
    route = data.draw(st.sampled_from(sorted({t.route for t in vlm.targets})), label="route")
    target = data.draw(st.sampled_from([t for t in vlm.targets if t.route == route]), label="target")
    post(vlm, target, data.draw(vision_bodies(route), label="body"), {"content-type": "application/json"})
