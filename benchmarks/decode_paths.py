"""The CUDA path's decode choices measured against each other in one run: CUDA graphs, the Triton paged
attention kernel and the torch attention (blocks gathered every layer).

    python benchmarks/decode_paths.py [--model-id DIR] [-o load_format=dummy] [--device cuda]
                                      [--concurrency 1,32] [--max-new-tokens T] [--json FILE]
                                      [--paths graphs,graphs-fused,triton,torch,graphs-sampled,...] [--lora N]
                                      [--context N]

The model is loaded once; for each path an engine is built over it, alone on the device, and the same
greedy prompts run at each concurrency (a warm-up request first, which also captures the graph of one
row): decode tokens/s of the batch, and whether every prompt's tokens equal the first path's (the
first position where one differs otherwise). Paths (by default all but the last two):

- ``graphs``: the default on CUDA, decode steps replayed as CUDA graphs over the Triton kernel;
- ``graphs-fused``: the same with the residual adds, RMS norms, rotary embeddings and SiLU products in Triton kernels
  (engine/model/fused_norm.py, `USE_ON_CUDA`; on a CPU the kernels stay off: the ``graphs`` path again); the
  report's ``fused_choice`` is what a server on this GPU measures and chooses at start (engine/model/fused_choice.py:
  one layer's element-wise work in CUDA graphs, eager and fused, at 1, 16 and 128 rows);
- ``triton``: ``enforce_eager=true``, the same kernel launched step by step;
- ``torch``: ``enforce_eager=true`` and ``LMISERVE_ATTENTION_BACKEND=torch``, the torch attention;
- ``graphs-sampled``: the graphs with every prompt sampled at temperature 1.0 (OpenAI's default), seeded,
  sampled inside the graphs (engine/runner/graph_sampling.py: the step's one replay, its rows drawn by the
  kernel of engine/runner/seeded_draw.py, chained into the next step on the device);
- ``graphs-sampled-eager``: the same sampled after the graph, from its logits (`graph_sampling.USE_IN_GRAPHS`
  off), drawn by the same kernel: the same tokens as ``graphs-sampled``, a wait and the sampler's launches
  a step more;
- ``graphs-sampled-generators``: the same with each row drawn by its own generator (`seeded_draw.USE_ON_CUDA`
  off: an exponential fill a row). Their tokens are compared with the first path's like the others', so
  they differ from the greedy path's; the two sampled paths draw different tokens too (other variates);
- ``graphs-sampled-top-p``: ``graphs-sampled`` with ``top_p`` 0.9: its graphs' kind with the top_k, top_p and
  min_p stages (a sort of the vocabulary a row), where ``graphs-sampled`` replays the kind without them;
- ``graphs-top-n``: ``graphs`` with each token's top 5 (OpenAI's ``top_logprobs``), taken from the graph's
  logits after the replay and sent with its pick (engine/runner/graph_sampling.py, `with_top_n`): the greedy
  tokens of ``graphs``, a ``topk`` of the vocabulary a step more;
- ``eager``: ``enforce_eager=true`` with the device's default attention (CUDA: the Triton kernel, as
  ``triton``; a CPU: the compiled kernel in fp32, torch's otherwise): lmiserve's forward step by step;
- ``generic``: ``fast_path=false``, eager: transformers' own forward over the blocks (engine/runner/generic.py),
  what a model outside the fast forward's architectures runs (Qwen3's until 2026-12-02).

``--lora N``: the engines serve N random LoRA adapters of rank 16 on every linear
(lmiserve/models/lora_demo.py) and the prompts name them in turn, one in N + 1 none: with ``graphs`` the
decode steps with adapters replay the graphs over fixed adapter slots (engine/lora/slots.py), with
``triton`` they run eagerly with the stacked products (engine/lora/batch.py).

Without --model-id: the tests' tiny Llama model. On a CPU the Triton paths need ``TRITON_INTERPRET=1``
(a check that the script runs, not a measurement) and no graph is captured.

``--context N``: each prompt opens with its own N words of filler (about a token each in SmolLM2's vocabulary), so
the decode steps attend over long contexts; ``decode_tokens_per_s`` counts the tokens made after every prompt's
first token over the time since then (the prompts' prefill left out).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tp_parity import PROMPTS, _generate, write_report  # noqa: E402


class Choice(NamedTuple):
    backend: str  # LMISERVE_ATTENTION_BACKEND
    eager: bool  # enforce_eager
    fused: bool = False  # engine/model/fused_norm.py's kernels
    sampled: bool = False  # the prompts sampled at temperature 1.0, seeded
    draw_kernel: bool = True  # a sampled step's rows drawn in one kernel (engine/runner/seeded_draw.py)
    in_graph: bool = True  # a sampled decode step's rows sampled inside its graph (engine/runner/graph_sampling.py)
    top_p: float = 1.0  # the sampled prompts' top_p
    top_n: int = 0  # each token's top-N too (OpenAI's top_logprobs)
    fast_path: bool = True  # lmiserve's own forward (False: transformers' over the blocks, the generic runner)


PATHS = {
    "graphs": Choice("triton", False),
    "graphs-fused": Choice("triton", False, fused=True),
    "triton": Choice("triton", True),
    "torch": Choice("torch", True),
    "graphs-sampled": Choice("triton", False, sampled=True),
    "graphs-sampled-eager": Choice("triton", False, sampled=True, in_graph=False),
    "graphs-sampled-top-p": Choice("triton", False, sampled=True, top_p=0.9),
    "graphs-sampled-generators": Choice("triton", False, sampled=True, draw_kernel=False),
    "graphs-top-n": Choice("triton", False, top_n=5),
    "eager": Choice("auto", True),
    "generic": Choice("auto", True, fast_path=False),
}
DEFAULT_PATHS = [path for path in PATHS if path not in ("eager", "generic")]  # the CUDA path's choices


def captured(graphs: Any, greedy: bool) -> list[Any] | None:
    """The sizes of the greedy graphs `graphs` captured, or the ``[size, kind]`` of its sampled ones."""
    if graphs is None:
        return None
    keys = sorted(getattr(graphs, "_graphs", {}))
    return [size for size, kind in keys if kind == "greedy"] if greedy else [[s, k] for s, k in keys if k != "greedy"]


_WORDS = "the river stone light house garden music paper window market winter letter morning story field".split()


def _filler(index: int, words: int) -> str:
    """Prompt `index`'s own ~`words` words (about a token each; empty for 0): a long context to attend over."""
    if not words:
        return ""
    pick = random.Random(index)
    return f"Notes {index}: " + " ".join(pick.choice(_WORDS) for _ in range(words)) + ".\n\n"


def _decode_rate(stamps: list[list[float]]) -> float | None:
    """Tokens made after every prompt's first token, a second since then (None: too few to tell)."""
    if not stamps or not all(stamps):
        return None
    start = max(times[0] for times in stamps)
    end = max(times[-1] for times in stamps)
    after = sum(t > start for times in stamps for t in times)
    return round(after / (end - start), 1) if end > start else None


def run(
    model_dir: str,
    options: dict[str, str],
    device: str,
    levels: list[int],
    tokens: int,
    paths: list[str] | None = None,
    adapters: dict[str, Path] | None = None,
    context: int = 0,
) -> dict[str, Any]:
    """Each of `paths` (default `DEFAULT_PATHS`) at each level; with `adapters` (name: folder) served and named by the
    prompts in turn (one in ``len(adapters) + 1`` the base model)."""
    import torch

    from lmiserve.config import Settings
    from lmiserve.engine.attention import triton_ops
    from lmiserve.engine.model import fused_choice, fused_norm
    from lmiserve.engine.runner import graph_sampling, seeded_draw
    from lmiserve.models.compose import build_engine
    from lmiserve.models.load import load_causal_lm

    if adapters:
        options = {**options, "enable_lora": "true", "max_loras": str(len(adapters))}
    names: list[str | None] = [*(adapters or {}), None]
    base = Settings.from_options({"model_id": model_dir, "device": device, **options})
    loaded = load_causal_lm(  # (``-o quantize=fp8`` and the rest as the server loads them)
        model_dir,
        dtype=base.dtype,
        device=device,
        trust_remote_code=base.trust_remote_code,
        load_format=base.load_format,
        quantize=base.quantize,
    )
    loaded = dataclasses.replace(loaded, device=torch.device(device))
    results: dict[str, Any] = {}
    shape: fused_choice.LayerShape | None = None  # the fast forward's, for the kernels' measured choice
    for path in paths or DEFAULT_PATHS:
        chosen = PATHS[path]
        os.environ["LMISERVE_ATTENTION_BACKEND"] = chosen.backend
        fused_norm.USE_ON_CUDA = chosen.fused  # read when an engine's forward is built
        seeded_draw.USE_ON_CUDA = chosen.draw_kernel  # read at each sampled step
        graph_sampling.USE_IN_GRAPHS = chosen.in_graph  # read at each sampled step
        settings = base.model_copy(update={"enforce_eager": chosen.eager, "fast_path": chosen.fast_path})
        runs = {}
        for level in levels:
            prompts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})") for i in range(level)]
            prompts = [_filler(i, context) + p for i, p in enumerate(prompts)]
            stamps: list[list[float]] = []
            engine = build_engine(loaded, settings)
            for name, folder in (adapters or {}).items():
                engine.adapters.register(name, folder)
            on = [names[i % len(names)] for i in range(level)] if adapters else None
            run = _generate(engine, prompts, tokens, on, chosen.sampled, chosen.top_p, chosen.top_n, stamps)
            outputs, seconds = asyncio.run(run)
            fast = getattr(engine.runner, "fast", None)
            graphs = getattr(fast, "graphs", None)
            if fast is not None and fast.plain_norms and shape is None:
                shape = fused_choice.LayerShape.of(fast)
            runs[str(level)] = {
                "tokens_per_s": sum(len(o) for o in outputs) / seconds,
                "decode_tokens_per_s": _decode_rate(stamps),
                "preemptions": engine.snapshot().preemptions,  # (a pool bound by `kv_cache_memory_bytes`)
                "outputs": outputs,
                "runner": engine.runner.path,
                "triton_attention": bool(getattr(fast, "triton", False)),
                "graphs_captured": captured(graphs, greedy=True),
                "sampled_graphs_captured": captured(graphs, greedy=False),
            }
            del engine
            gc.collect()
            if device != "cpu":
                torch.cuda.empty_cache()
        results[path] = runs
    first = next(iter(results))
    report: dict[str, Any] = {"device": device, "max_new_tokens": tokens, "lora_adapters": len(adapters or {})}
    report["paths"] = {}
    if device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
    # what a server on this device chooses for the fused element-wise kernels (engine/model/fused_choice.py)
    measurable = fused_norm.available() and (device.startswith("cuda") or triton_ops.interpreting())
    if shape is not None and measurable:
        report["fused_choice"] = fused_choice.measure(shape, loaded.dtype, torch.device(device)).as_dict()
    for path, runs in results.items():
        report["paths"][path] = {}
        for level, run_ in runs.items():
            reference = results[first][level]["outputs"]
            report["paths"][path][level] = {
                "tokens_per_s": round(run_["tokens_per_s"], 1),
                "decode_tokens_per_s": run_["decode_tokens_per_s"],
                "over_" + first: round(run_["tokens_per_s"] / results[first][level]["tokens_per_s"], 3),
                "identical_to_" + first: sum(a == b for a, b in zip(run_["outputs"], reference)),
                "first_difference": [
                    next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                    for a, b in zip(run_["outputs"], reference)
                ],
                "runner": run_["runner"],
                "preemptions": run_["preemptions"],
                "triton_attention": run_["triton_attention"],
                "graphs_captured": run_["graphs_captured"],
                "sampled_graphs_captured": run_["sampled_graphs_captured"],
            }
            if path == "graphs-sampled-eager" and "graphs-sampled" in results:  # the same draws, in the graph or not
                inside = results["graphs-sampled"][level]["outputs"]
                report["paths"][path][level]["identical_to_graphs-sampled"] = sum(
                    a == b for a, b in zip(run_["outputs"], inside)
                )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", help="model directory (default: the tests' tiny model)")
    parser.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", default="1,32", help="concurrent prompts, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the report here too")
    parser.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        help="the paths to run, comma-separated (default all but eager, generic)",
    )
    parser.add_argument("--lora", type=int, default=0, metavar="N", help="serve N random LoRA adapters (rank 16)")
    parser.add_argument("--context", type=int, default=0, metavar="N", help="open each prompt with ~N words of its own")
    args = parser.parse_args(argv)
    options = dict(item.split("=", 1) for item in args.options)
    levels = [int(c) for c in args.concurrency.split(",")]
    paths = args.paths.split(",")
    if unknown := [p for p in paths if p not in PATHS]:
        parser.error(f"unknown path(s) {', '.join(unknown)}; the paths: {', '.join(PATHS)}")
    if args.lora < 0:
        parser.error("--lora takes a count of adapters (0: none)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_id
        if model_dir is None:
            from tests.helpers.tiny_model import build_tiny_model_dir

            model_dir = str(build_tiny_model_dir(Path(tmp) / "tiny"))
        adapters = None
        if args.lora:
            from lmiserve.models.lora_demo import LORA_TARGETS, make_adapters

            adapters = make_adapters(Path(model_dir), Path(tmp) / "adapters", args.lora, 16, LORA_TARGETS["all"])
        report = run(model_dir, options, args.device, levels, args.max_new_tokens, paths, adapters, args.context)
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
