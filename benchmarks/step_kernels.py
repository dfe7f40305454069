"""The device kernels a decode step of the CUDA path launches, counted on a CPU (issue #39): the step the decode
graphs capture (`DecodeGraphs._step`: the layers, the logits, the greedy pick), run from the graphs' fixed
buffers without a capture, the Triton attention and the fused kernels under Triton's interpreter.

    TRITON_INTERPRET=1 python benchmarks/step_kernels.py [--rows 1] [--arch llama|qwen3] [--out FILE]

What is counted, each a kernel a GPU's graph replays: every aten op that computes (views, aliases and
allocations are not: a graph replays no kernel for them) and every Triton launch (one a launch; the ops the
interpreter runs inside one are not counted). The matrix products on a CPU take the CPU's product paths, so
the counts are compared between the ways the step's element-wise work runs, not read as a GPU's totals:

- ``eager``: the eager ops (``LMISERVE_FUSED_ELEMENTWISE=0``);
- ``fused, rope alone``: `fused_norm`'s kernels, the rotation alone, the keys and values stored by the Triton
  backend's `forward` (copied out of the q/k/v rows, each ``index_copy_``d): the fused path before 2026-12-05;
- ``fused``: the rotation's kernel also storing the keys and values (`fused_norm.rope_store`).

Each way runs a model of 2 and of 4 layers (Llama-3.1-8B's head layout scaled down: 32 query heads of 8 and 8
kv heads; ``--arch qwen3``: Qwen3's layers, each q and k head normed before its rotation), so a layer's count
is half the difference, and what is left of the 4 layers' step is the step's own (the embedding, the RoPE rows,
the final norm, the output projection, the greedy pick and its copies); an fp8 (e4m3) KV cache is counted too,
whose store the eager ops quantize in several kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (the Triton kernels run under the interpreter on a CPU)")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmiserve.engine.attention import cuda_graphs, triton_ops
from lmiserve.engine.attention.backends import TritonBackend
from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache
from lmiserve.engine.model import fast_llama, fused_choice, fused_norm

WAYS = ("eager", "fused, rope alone", "fused")
ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "lift_fresh", "detach", "alias"}


def tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class Kernels(TorchDispatchMode):
    """Counts the aten ops that compute, outside Triton's interpreted launches (`launches` counts those)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self.inside = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if self.inside or name in ALLOCATIONS:
            return out
        if func.is_view:  # (also `to` and `reshape`, which copy where they cannot alias: then a kernel)
            given = {t.untyped_storage().data_ptr() for t in tensors(args)}
            if all(t.untyped_storage().data_ptr() in given for t in tensors(out)):
                return out
        self.ops[name] += 1
        return out

    @contextmanager
    def counting_launches(self) -> Iterator[None]:
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def counted(function: Any, *args: Any, **kwargs: Any) -> Any:
            self.launches[function.fn.__name__] += 1
            self.inside += 1
            try:
                return run(function, *args, **kwargs)
            finally:
                self.inside -= 1

        InterpretedFunction.run = counted  # type: ignore[method-assign]
        try:
            yield
        finally:
            InterpretedFunction.run = run  # type: ignore[method-assign]

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + sum(self.launches.values())


def model_of(layers: int, arch: str = "llama") -> Any:
    """A random model of `arch` (``llama``; ``qwen3``: each q and k head normed before its rotation)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    config = config_class(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_class(config).eval()


@torch.inference_mode()
def count(layers: int, way: str, kv_dtype: torch.dtype | None, rows: int, arch: str = "llama") -> Kernels:
    """One decode step of `rows` rows of a model of `arch` (`model_of`) of `layers` layers, `way` (`WAYS`), over a KV
    cache of `kv_dtype` (None: the model's)."""
    fused_norm.USE_ON_CUDA = way != "eager"
    fused_norm.wanted = lambda device: True  # type: ignore[assignment]
    fused_choice._verdicts.clear()
    os.environ["LMISERVE_ATTENTION_BACKEND"] = "triton"
    model = model_of(layers, arch)
    shape = AttentionShape.of(model.config)
    blocks = 16
    cpu = torch.device("cpu")
    cache = PagedKVCache(layers, blocks + 1, 16, shape.kv_heads, shape.head_dim, model.dtype, cpu, kv_dtype=kv_dtype)
    fast = fast_llama.FastLlama(model, cache, 128)
    assert isinstance(fast.attention, TritonBackend) and fast.fused_elementwise == (way != "eager")
    if way == "fused, rope alone":
        fast.attention.store_target = lambda layer, meta: None  # type: ignore[method-assign]
    graphs = cuda_graphs.DecodeGraphs(fast, rows, blocks, capture=False)
    tables = [[i] for i in range(rows)]
    graphs.run([5] * rows, [3] * rows, tables)  # (a first step: any one-time work done)
    kernels = Kernels()
    with kernels.counting_launches(), kernels:
        graphs.run([7] * rows, [4] * rows, tables)
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--arch", choices=("llama", "qwen3"), default="llama")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    assert triton_ops.interpreting()
    report: dict[str, Any] = {"rows": args.rows, "arch": args.arch, "ways": {}}
    for cache_name, kv_dtype in (("model dtype", None), ("e4m3", torch.float8_e4m3fn)):
        for way in WAYS:
            two, four = (count(layers, way, kv_dtype, args.rows, args.arch) for layers in (2, 4))
            a_layer = (four.total - two.total) / 2
            outside = four.total - 4 * a_layer  # the embedding, the RoPE rows, the final norm, the logits, the pick
            ops = {k: (four.ops[k] - two.ops[k]) / 2 for k in four.ops if four.ops[k] != two.ops[k]}
            launches = {k: (four.launches[k] - two.launches[k]) / 2 for k in four.launches}
            report["ways"][f"{way} / {cache_name}"] = {
                "kernels_a_layer": a_layer, "kernels_outside_the_layers": outside, "aten_ops_a_layer": ops,
                "triton_launches_a_layer": launches,
            }  # fmt: skip
            print(f"{way:18s} {cache_name:12s} a layer {a_layer:5.1f}, outside {outside:5.1f} (aten {ops}; {launches})")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
