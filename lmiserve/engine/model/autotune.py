"""Start-up autotune of the fast path's CPU kernel choices, cached per CPU, torch and model.

Which product shapes are fastest depends on the CPU: on the AMD EPYC the engine was first tuned on,
row blocks made a 1-row step 2x faster and transposed products helped from 8 rows; on an Intel Xeon
the same choices lost (benchmarks/README.md). So at start-up the fast runner times a few decode steps
of the loaded model per candidate and keeps the fastest:

- few rows (timed at batch 1): `CpuGemm` row blocks or plain ``F.linear``;
- many rows (timed at batch `LARGE_BATCH`, or the most rows a step runs if smaller): transposed products with
  rows padded to a multiple of 8, or plain ``F.linear``;
- a few rows (timed on one sequence's chunks of `FEW_PROBES` tokens, fp32): the compiled few-row
  kernel (`skinny_gemm`) for products of 2 to `cpu_gemm.FEW_ROWS` rows (a request's last token and
  its drafts), for 2 to `FEW_SHORT` rows only, or the choices above;
- decode attention (timed at both batches): the compiled kernel (an fp32 or bf16 cache) or the torch ops.

Candidates run in interleaved rounds and each keeps its fastest step (the least disturbed by other
work on a shared machine). Timing uses the runner's own cache at positions up to ~200 over whatever
the pool's blocks hold (no request is running yet, and a sequence only ever reads positions it wrote).
Every choice computes the same function up to the kernels' summation order (the greedy-parity tests
run on every path), so autotuning never changes a result beyond that.

The result is cached in a JSON file (`autotune_cache`, default ``<user cache dir>/lmiserve/
autotune.json``) under a key of CPU model, kernel flags, torch version and threads, model shape and
dtype; later starts read it. Past `BUDGET_S` (a busy machine) the static defaults are kept, and cached
as such for `RETRY_S` (then measured again). Models under `MIN_WEIGHTS` weights keep the static
defaults (a step of a few milliseconds is too short to time reliably, and the choice hardly matters).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmiserve.core.cpu_info import cpu_info
from lmiserve.engine.attention import cpu_kernel as compiled_attention
from lmiserve.engine.model import skinny_gemm
from lmiserve.engine.model.cpu_gemm import FEW_ROWS, CpuGemm
from lmiserve.engine.model.fast_llama import StepInputs
from lmiserve.engine.model.input_order import scales_of
from lmiserve.engine.model.int4_triton import Int4Scales
from lmiserve.engine.model.int8_weights import Int8Scales

if TYPE_CHECKING:
    from lmiserve.engine.model.fast_llama import FastLlama
    from lmiserve.engine.model.llama_layout import Part

log = logging.getLogger(__name__)

LARGE_BATCH = 32
MIN_WEIGHTS = 50_000_000  # models with fewer weights keep the static defaults
SMALL_REPEATS, LARGE_REPEATS = 5, 3  # timed steps per candidate (after one untimed)
BUDGET_S = 10.0  # stop timing (and keep the static defaults) after this long
RETRY_S = 3600.0  # a start that ran out of time is cached as static; measure again after this long
FEW_PROBES = (3, 8)  # chunk lengths at which the few-row kernel is timed against the BLAS choices
FEW_SHORT = 4  # its rows when it wins at the first probe only
# of the cache entries (2: the few-row kernel; 3: group-quantized int4/q8 kernels on TBB; 4: the compute and KV
# cache dtypes in the key, the compiled attention over a bf16 cache)
VERSION = 4
BUSY_LOAD = 1.5  # 1-minute load average per logical CPU above which timings are not trusted for good


@dataclass(frozen=True)
class KernelChoice:
    """What the fast path runs with, and why."""

    gemm: CpuGemm
    compiled_attention: bool
    source: str  # "measured", "cache", "static" (not autotuned) or "static (<why>)"
    timings_ms: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        attention = "compiled" if self.compiled_attention else "torch"
        timings = ", ".join(f"{k} {v:.1f}" for k, v in self.timings_ms.items())
        detail = f"{self.source}; ms a step: {timings}" if timings else self.source
        return f"products: {self.gemm.describe()}; decode attention: {attention} ({detail})"


def default_cache_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("lmiserve")) / "autotune.json"


def cache_key(fast: FastLlama, slots: int) -> str:
    """CPU model and kernel flags, torch version and threads, model shape and weight kind, compute and KV cache
    dtypes (a quantized model's weight kind is the same in fp32 and bf16; an fp8 pool rules out the compiled
    attention), batch."""
    cpu = cpu_info()
    layer = fast.layers[0]
    weights = "+".join(sorted({_weight_kind(part, fast.dtype) for part in layer.parts()}))
    shape = (
        f"layers={len(fast.layers)},hidden={fast.embed.shape[1]},inter={layer.intermediate},"
        f"heads={fast.heads}/{fast.kv_heads}x{fast.head_dim},vocab={fast.vocab}"
    )
    return (
        f"v{VERSION}|{cpu.model}|{' '.join(cpu.flags)}|torch {torch.__version__} x{torch.get_num_threads()}|"
        f"{shape}|{weights}|{_dtype_name(fast.dtype)}, kv {_dtype_name(fast.cache.kv_dtype)}|"
        f"batch {min(slots, LARGE_BATCH)}"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _weight_kind(part: Part, dtype: torch.dtype) -> str:
    """A product's weights: int4, q8 (int8 with group scales), int8 (rows) or the model's float dtype."""
    scales = scales_of(part.scales)
    if scales is None:
        return _dtype_name(dtype)
    if part.weight.dtype == torch.uint8 or isinstance(scales, Int4Scales):
        return "int4"
    if isinstance(scales, Int8Scales):
        return "int8 codes"
    if part.weight.dtype == torch.float8_e4m3fn:
        return "fp8"
    return "q8" if scales.dim() == 2 else "int8"


def model_weights(fast: FastLlama) -> int:
    """How many weights the fast forward reads (layer matrices, embeddings, output projection)."""
    per_layer = sum(part.weight.numel() for layer in fast.layers[:1] for part in layer.parts())
    return per_layer * len(fast.layers) + fast.embed.numel() + fast.lm_head.numel()


def choose(fast: FastLlama, slots: int, cache_path: str | os.PathLike[str] | None = None) -> KernelChoice:
    """The kernel choice for `fast` on this CPU: cached, measured (and cached), or the static default.
    Also applies it to `fast`."""
    static = KernelChoice(fast.gemm, fast.compiled_attention, "static")
    if fast.device.type != "cpu":
        return static
    if model_weights(fast) < MIN_WEIGHTS:
        return KernelChoice(fast.gemm, fast.compiled_attention, f"static (model under {MIN_WEIGHTS:,} weights)")
    path = Path(cache_path) if cache_path else default_cache_path()
    key = cache_key(fast, slots)
    entries = _read(path)
    entry = entries.get(key)
    if isinstance(entry, dict) and entry.get("incomplete") and time.time() - float(entry.get("at", 0)) > RETRY_S:
        entry = None  # the last try ran out of time long enough ago: measure again
    if isinstance(entry, dict):
        try:
            choice = KernelChoice(
                CpuGemm.from_dict(entry["gemm"]),
                bool(entry["compiled_attention"]),
                f"cache {path}",
                {k: float(v) for k, v in entry.get("timings_ms", {}).items()},
            )
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring a malformed autotune entry in %s", path)
        else:
            fast.use_kernels(choice.gemm, choice.compiled_attention)
            return choice
    busy = machine_busy()
    choice = measure(fast, slots)
    busy = busy or machine_busy()
    if busy:
        log.warning(
            "CPU autotune measured on a busy machine (load average above %.1f): measured again after %.0f s",
            BUSY_LOAD * (os.cpu_count() or 1),
            RETRY_S,
        )
    entries[key] = {
        "gemm": choice.gemm.to_dict(),
        "compiled_attention": choice.compiled_attention,
        "timings_ms": choice.timings_ms,
        "cpu": cpu_info().as_dict(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "at": time.time(),
        # out of time, or timed while other work competed for the cores: kept for RETRY_S only, so
        # that every start of the next hour does not spend the budget again, and a quiet start measures
        "incomplete": choice.source != "measured" or busy,
    }
    _write(path, entries)
    return choice


def machine_busy() -> bool:
    """True when other work competes for the cores: the 1-minute load average is above `BUSY_LOAD` per
    logical CPU (timings taken then can pick the wrong kernels, as seen at load 6-12 on 2 cores)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this OS
        return False
    return load > BUSY_LOAD * (os.cpu_count() or 1)


@torch.inference_mode()
def measure(fast: FastLlama, slots: int) -> KernelChoice:
    """Time the candidates on `fast` (see the module docstring); leaves `fast` on the winner."""
    large = min(slots, LARGE_BATCH)
    default = fast.gemm
    threads = max(2, torch.get_num_threads())
    blocks = CpuGemm.tuned_default(threads).with_(few_rows=0)
    plain = CpuGemm.plain()
    compiled_ok = compiled_attention.available(fast.cache.kv_dtype, fast.device)  # (fp32, bf16, fp8 pools)
    deadline = time.monotonic() + BUDGET_S
    timings: dict[str, float] = {}

    def step(rows: int) -> Callable[[], object]:
        top = max(1, fast.max_context - 1)  # never past the model's context
        positions = [min(top, 32 + (i * 131) % 160) for i in range(rows)] if rows > 1 else [min(top, 100)]
        ids = [5 + i for i in range(rows)]
        size, count = fast.cache.block_size, fast.cache.num_blocks  # before any request: any blocks will do
        tables = [[(row * 13 + j) % count for j in range(-(-(p + 1) // size))] for row, p in enumerate(positions)]
        inputs = StepInputs(ids, positions, tables, keep=list(range(rows)))
        return lambda: fast.forward(inputs)

    def chunk(tokens: int) -> Callable[[], object]:
        """One sequence's chunk of `tokens` tokens at position ~100, every logit kept (draft verification)."""
        start = max(0, min(100, fast.max_context - tokens))
        cache = fast.cache
        key = [(7 + j) % cache.num_blocks for j in range(-(-(start + tokens) // cache.block_size))]
        inputs = StepInputs(chunks=[(key, start, [5 + i for i in range(tokens)])], keep=list(range(tokens)))
        return lambda: fast.forward(inputs)

    def race(
        rows: int, repeats: int, candidates: dict[str, tuple[CpuGemm, bool]], as_chunk: bool = False
    ) -> dict[str, float]:
        best = {name: float("inf") for name in candidates}
        run = chunk(rows) if as_chunk else step(rows)
        for round_ in range(repeats + 1):
            for name, (gemm, compiled) in candidates.items():
                if time.monotonic() > deadline:
                    return best
                fast.use_kernels(gemm, compiled)
                start = time.perf_counter()
                run()
                if round_:  # the first round warms up
                    best[name] = min(best[name], (time.perf_counter() - start) * 1000)
        return best

    attention = compiled_ok
    small = race(1, SMALL_REPEATS, {"blocks": (blocks, attention), "plain": (plain, attention)})
    splits = blocks.splits if small["blocks"] < small["plain"] else 1
    big = race(
        large,
        LARGE_REPEATS,
        {"transposed": (blocks.with_(splits=splits), attention), "plain": (plain.with_(splits=splits), attention)},
    )
    gemm = (blocks if big["transposed"] < big["plain"] else plain).with_(splits=splits, few_rows=0)
    timings.update({f"b1 {k}": round(v, 2) for k, v in small.items()})
    timings.update({f"b{large} {k}": round(v, 2) for k, v in big.items()})
    if skinny_gemm.available(fast.dtype, fast.device):
        few = 0
        for probe, rows_if_won in zip(FEW_PROBES, (FEW_SHORT, FEW_ROWS)):
            few_rows = {"few-row": (gemm.with_(few_rows=FEW_ROWS), attention), "blas": (gemm, attention)}
            won = race(probe, SMALL_REPEATS, few_rows, as_chunk=True)
            timings.update({f"chunk {probe} {k}": round(v, 2) for k, v in won.items()})
            if not won["few-row"] < won["blas"]:
                break
            few = rows_if_won
        gemm = gemm.with_(few_rows=few)
    if compiled_ok:
        att_small = race(1, SMALL_REPEATS, {"compiled": (gemm, True), "torch": (gemm, False)})
        att_big = race(large, LARGE_REPEATS, {"compiled": (gemm, True), "torch": (gemm, False)})
        ratio = (att_small["compiled"] / att_small["torch"]) * (att_big["compiled"] / att_big["torch"])
        attention = not ratio > 1.0  # inf / inf (out of time) keeps the compiled kernel
        timings.update({f"b1 attention {k}": round(v, 2) for k, v in att_small.items()})
        timings.update({f"b{large} attention {k}": round(v, 2) for k, v in att_big.items()})
    timings = {k: v for k, v in timings.items() if v != float("inf")}
    if time.monotonic() > deadline:
        fast.use_kernels(default, compiled_ok)
        return KernelChoice(default, compiled_ok, f"static (autotune over its {BUDGET_S:.0f} s budget)", timings)
    fast.use_kernels(gemm, attention)
    return KernelChoice(gemm, attention, "measured", timings)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("cannot read the autotune cache %s (%s); measuring again", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, entries: dict[str, Any]) -> None:
    """Write atomically (a temporary sibling renamed into place); a failure costs only the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".autotune-", delete=False) as tmp:
            json.dump(entries, tmp, indent=1, sort_keys=True)
        os.replace(tmp.name, path)
    except OSError as exc:
        log.warning("cannot write the autotune cache %s: %s", path, exc)
