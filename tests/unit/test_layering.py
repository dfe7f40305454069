"""The dependency direction of ARCHITECTURE.md: core imports nothing of ours; only engine and models
import torch/transformers; the engine knows nothing of HTTP, adapters or formatters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lmiserve"
HEAVY = {"torch", "transformers"}
HTTP = {"starlette", "uvicorn", "sse_starlette"}


def imports_of(path: Path, *, members: bool = False) -> set[str]:
    """Dotted names of the modules `path` imports; with `members`, ``from x import y`` also counts as
    ``x.y`` (y may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if members:
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


def roots(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


@pytest.mark.parametrize("path", modules("core"), ids=lambda p: p.name)
def test_core_imports_only_core(path):
    ours = {n for n in imports_of(path) if n.startswith("lmiserve")}
    assert all(n.startswith("lmiserve.core") for n in ours), ours
    assert not roots(imports_of(path)) & (HEAVY | HTTP)


@pytest.mark.parametrize(
    "path",
    [p for layer in ("protocols", "config", "server") for p in modules(layer)],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_only_engine_and_models_import_torch(path):
    assert not roots(imports_of(path)) & HEAVY


@pytest.mark.parametrize("path", modules("engine"), ids=lambda p: p.name)
def test_engine_is_free_of_http_and_protocols(path):
    names = imports_of(path)
    assert not roots(names) & HTTP
    assert not any(n.startswith(("lmiserve.server", "lmiserve.protocols")) for n in names)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_exporter_imports_opentelemetry(path):
    """Tracing off costs nothing: OpenTelemetry is imported only by server/otlp.py, which server/tracing.py
    imports when tracing starts (the engine and core never know about it)."""
    if path != PACKAGE / "server" / "otlp.py":
        assert "opentelemetry" not in roots(imports_of(path))


def test_scheduler_is_pure_python():
    for name in ("scheduler.py", "sequence.py", "detokenizer.py", "stop.py", "async_engine.py"):
        assert not roots(imports_of(PACKAGE / "engine" / name)) & HEAVY, name


@pytest.mark.parametrize("path", modules("bench"), ids=lambda p: f"bench/{p.name}")
def test_bench_imports_torch_only_in_its_baselines(path):
    """`lmiserve bench` may run the model in process (baselines.py); the rest stays torch-free so the
    CLI and the load generator start fast."""
    if path.name != "baselines.py":
        assert not roots(imports_of(path)) & HEAVY


# ---- protocols never import each other --------------------------------------------------------------

PROTOCOLS = ("lmi", "tgi", "openai", "anthropic", "tensor", "tei")


def lmiserve_modules_imported(path: Path) -> set[str]:
    """Every lmiserve module `path` imports, ``from lmiserve.x import y`` counted as both."""
    return {n for n in imports_of(path, members=True) if n.startswith("lmiserve")}


def protocol_of(name: str) -> str | None:
    """The protocol package a dotted module name belongs to (None outside lmiserve.protocols)."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["lmiserve", "protocols"] else None


@pytest.mark.parametrize(
    "path",
    [p for name in PROTOCOLS for p in modules(f"protocols/{name}")],
    ids=lambda p: f"{p.relative_to(PACKAGE / 'protocols').parts[0]}/{p.name}",
)
def test_protocols_never_import_each_other(path):
    own = path.relative_to(PACKAGE / "protocols").parts[0]
    foreign = {n for n in lmiserve_modules_imported(path) if protocol_of(n) in set(PROTOCOLS) - {own}}
    assert not foreign, foreign


@pytest.mark.parametrize("path", modules("protocols/textgen"), ids=lambda p: f"textgen/{p.name}")
def test_textgen_is_owned_by_no_protocol(path):
    """What TGI and OpenAI share (`protocols/textgen`, a neutral helper) imports neither of them (nor any
    other protocol)."""
    assert not {n for n in lmiserve_modules_imported(path) if protocol_of(n) in PROTOCOLS}


@pytest.mark.parametrize(
    "path",
    [
        p
        for layer in ("server", "models", "config", "engine", "core")
        for p in modules(layer)
        if p.name not in ("app.py", "invocations.py")
    ],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_only_the_app_and_the_dispatcher_import_protocols(path):
    """Protocols sit on top: below them nothing imports one, except the two modules that wire them
    (`server/app.py`, the route table, and `server/invocations.py`, the /invocations dispatcher)."""
    assert not {n for n in lmiserve_modules_imported(path) if protocol_of(n)}


def test_test_modules_have_unique_names():
    """The test folders are not packages: two test modules of one name in different folders collide at
    import ("import file mismatch") when one pytest run collects both."""
    tests = PACKAGE.parent / "tests"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
