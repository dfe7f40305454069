"""The dependency direction of docs/architecture.md: core and config import nothing of ours; the engine
imports only core (no settings, no model loading, no HTTP, no protocols); only engine and models import
torch/transformers; models import no HTTP framework; no import circle anywhere.

Every import statement of a module counts: at the top, inside a function (a lazy import) and under
`if TYPE_CHECKING:` (a type-only import still ties the files together for a reader)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lmiserve"
HEAVY = {"torch", "transformers"}
HTTP = {"starlette", "uvicorn", "sse_starlette"}


def module_name(path: Path) -> str:
    """The dotted name of a module of the package (``lmiserve.models`` for models/__init__.py)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(path: Path) -> Iterator[tuple[str, list[str]]]:
    """Every import statement of `path`, wherever it is (module level, a function, a class, an
    ``if TYPE_CHECKING:`` block): ``(module, names)``, names empty for ``import module``. A relative
    import is resolved against `path`'s package."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = module_name(path).split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - (node.level - 1)]
                module = ".".join([*package, module] if module else package)
            yield module, [alias.name for alias in node.names]


def imports_of(path: Path, *, members: bool = False) -> set[str]:
    """Dotted names of the modules `path` imports; with `members`, ``from x import y`` also counts as
    ``x.y`` (y may be a module)."""
    names: set[str] = set()
    for module, members_of in import_statements(path):
        names.add(module)
        if members:
            names.update(f"{module}.{name}" for name in members_of)
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


@pytest.mark.parametrize("path", modules("config"), ids=lambda p: p.name)
def test_config_imports_nothing_of_ours(path):
    """The settings are read by everything above the engine and know nothing of it."""
    assert all(n.startswith("lmiserve.config") for n in imports_of(path) if n.startswith("lmiserve")), path


@pytest.mark.parametrize("path", modules("engine"), ids=lambda p: str(p.relative_to(PACKAGE / "engine")))
def test_engine_imports_only_core(path):
    """The engine takes plain values: no settings (`lmiserve.config`: the composition above it,
    models/compose.py, turns them into an `EngineConfig`), no model loading (`lmiserve.models`: a loaded
    model, or a loader, is handed down), no HTTP, no protocols, no server."""
    names = imports_of(path)
    assert not roots(names) & HTTP
    ours = {n for n in names if n.startswith("lmiserve")}
    assert all(n.startswith(("lmiserve.core", "lmiserve.engine")) for n in ours), sorted(ours)


@pytest.mark.parametrize("path", modules("oneshot"), ids=lambda p: str(p.relative_to(PACKAGE / "oneshot")))
def test_oneshot_imports_only_core_and_the_torch_thread(path):
    """The one-forward models' batcher beside the LLM engine: plain values from core, the model's torch
    thread shared with the engine (engine/torch_thread.py), nothing of the engine's generation."""
    names = imports_of(path)
    assert not roots(names) & HTTP
    ours = {n for n in names if n.startswith("lmiserve")}
    allowed = ("lmiserve.core", "lmiserve.oneshot", "lmiserve.engine.torch_thread")
    assert all(n.startswith(allowed) for n in ours), sorted(ours)


@pytest.mark.parametrize("path", modules("models"), ids=lambda p: str(p.relative_to(PACKAGE / "models")))
def test_models_import_no_http(path):
    """Finding a request's model is the server's (server/lookup.py): `models/` takes names, not requests."""
    assert not roots(imports_of(path)) & HTTP


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_exporter_imports_opentelemetry(path):
    """Tracing off costs nothing: OpenTelemetry is imported only by server/otlp.py, which server/tracing.py
    imports when tracing starts (the engine and core never know about it)."""
    if path != PACKAGE / "server" / "otlp.py":
        assert "opentelemetry" not in roots(imports_of(path))


def test_scheduler_is_pure_python():
    for name in (
        "core/scheduler.py",
        "core/block_scheduler.py",
        "core/kv_blocks.py",
        "core/sequence.py",
        "core/engine_core.py",
        "core/async_engine.py",
        "text/detokenizer.py",
        "text/stop.py",
    ):
        assert not roots(imports_of(PACKAGE / "engine" / name)) & HEAVY, name


@pytest.mark.parametrize("path", modules("bench"), ids=lambda p: f"bench/{p.name}")
def test_bench_imports_torch_only_in_its_baselines(path):
    """`lmiserve bench` may run the model in process (baselines.py, baselines_vision.py); the rest stays
    torch-free so the CLI and the load generator start fast."""
    if path.name not in ("baselines.py", "baselines_vision.py"):
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
        if p != PACKAGE / "server" / "app.py"
    ],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_only_the_app_imports_protocols(path):
    """Protocols sit on top: below them nothing imports one, except the route table that wires them
    (`server/app.py`). The /invocations dispatcher, which wires several, lives with them
    (`protocols/invocations.py`)."""
    assert not {n for n in lmiserve_modules_imported(path) if protocol_of(n)}


DISPATCHER = "lmiserve.protocols.invocations"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_app_imports_the_dispatcher(path):
    """The /invocations dispatcher sits above the protocols it dispatches to (none imports it); only the
    route table (`server/app.py`) does."""
    if path != PACKAGE / "server" / "app.py":
        assert DISPATCHER not in lmiserve_modules_imported(path)


# ---- no import circle ----------------------------------------------------------------------------------

MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def edges_of(path: Path) -> set[str]:
    """The lmiserve modules `path` imports: ``from pkg import name`` is the module ``pkg.name`` when there
    is one, else ``pkg`` (its __init__.py); ``import a.b.c`` the longest of a.b.c, a.b, a that is a
    module. The parent packages Python imports on the way are not counted (every submodule has them)."""
    targets: set[str] = set()
    for module, names in import_statements(path):
        if not module.startswith("lmiserve"):
            continue
        found = [f"{module}.{n}" if f"{module}.{n}" in MODULES else module for n in names] or [module]
        for name in found:
            parts = name.split(".")
            while parts and ".".join(parts) not in MODULES:
                parts.pop()
            targets.add(".".join(parts))
    return targets - {module_name(path), ""}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_import_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_edges_count_lazy_type_only_and_submodule_imports():
    edges = edges_of(PACKAGE / "engine" / "attention" / "cuda_graphs.py")
    assert "lmiserve.engine.attention.triton_ops" in edges  # `from lmiserve.engine.attention import triton_ops`
    assert "lmiserve.engine.attention" not in edges  # ... which is no import of attention/__init__.py's names
    assert "lmiserve.engine.model.fast_llama" in edges  # under `if TYPE_CHECKING:`


def test_no_import_circles():
    """No module imports, through any chain of imports of any kind, one that imports it: the package reads
    bottom up. A circle is broken by moving what both need into the lower module, or a new small one."""
    graph = {name: edges_of(path) for name, path in MODULES.items()}
    circles = import_circles(graph)
    described = ["; ".join(f"{a} -> {b}" for a in circle for b in sorted(graph[a] & set(circle))) for circle in circles]
    assert not circles, "\n".join(described)


def test_test_modules_have_unique_names():
    """The test folders are not packages: two test modules of one name in different folders collide at
    import ("import file mismatch") when one pytest run collects both."""
    tests = PACKAGE.parent / "tests"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


# ---- no module over 400 lines --------------------------------------------------------------------------

MAX_LINES = 400
# Generated code is exempt: protoc's and grpc's modules (protocols/tensor/kserve/grpc/*_pb2*.py) open with
# a "# Generated by the ... DO NOT EDIT!" comment, and only they may (test_only_protobuf_code_is_generated).
GENERATED = "protocols/tensor/kserve/grpc/*_pb2*.py"


def is_generated(path: Path) -> bool:
    """A module a code generator wrote: a comment of its first lines says "Generated by ... DO NOT EDIT"."""
    head = path.read_text().splitlines()[:5]
    return any(line.startswith("#") and "Generated by" in line and "DO NOT EDIT" in line for line in head)


def test_only_protobuf_code_is_generated():
    """The exemption from the line limit is the protobuf code's, and nothing else claims it."""
    generated = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py")) if is_generated(p)]
    assert generated, "the generated protobuf modules are no longer recognised"
    assert all(fnmatch(name, GENERATED) for name in generated), generated


def test_no_module_over_400_lines():
    """A module over 400 lines holds more than one concern: split it into cohesive modules named for
    what they do (issue #36)."""
    lines = {p: len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py")) if not is_generated(p)}
    long = {p: n for p, n in lines.items() if n > MAX_LINES}
    listed = "\n".join(f"  {n:>5}  {p.relative_to(PACKAGE.parent)}" for p, n in long.items())
    if long:
        pytest.fail(f"{len(long)} modules over {MAX_LINES} lines (split them by concern):\n{listed}", pytrace=False)
