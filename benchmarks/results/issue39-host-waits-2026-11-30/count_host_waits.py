"""How often an eager step's forward makes the host wait for the device (a blocking copy to it, a value read
back), counted on a CPU with tests/helpers/capture_hazards.py (issue #39, 2026-11-30).

Run from a checkout's root; HAZARDS_HELPER names the helper to count with (default this checkout's), so a
checkout from before the helper existed is counted with today's:

    HAZARDS_HELPER=/path/to/tests/helpers/capture_hazards.py PYTHONPATH=. python count_host_waits.py

The tests' tiny Llama, six prompts served at once with chunks of 8 prompt tokens beside decode rows (the
steps a GPU runs eagerly), each path's forward watched: lmiserve's forward and transformers' over the
blocks, each through the Triton kernel (under its interpreter) and through the torch attention (a GPU's
without Triton; the CPU's compiled kernel is left out).
"""

import asyncio
import collections
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, "tests")
helper = os.environ.get("HAZARDS_HELPER", "tests/helpers/capture_hazards.py")
spec = importlib.util.spec_from_file_location("hazards_helper", helper)
ch = importlib.util.module_from_spec(spec)
sys.modules["hazards_helper"] = ch
spec.loader.exec_module(ch)

from helpers.llama_variants import serve_prompts  # noqa: E402
from helpers.tiny_model import build_tiny_model_dir  # noqa: E402
from lmiserve.engine.core.async_engine import EngineConfig  # noqa: E402
from lmiserve.engine.model.fast_llama import FastLlama  # noqa: E402
from lmiserve.engine.runner.generic import PagedGenericRunner  # noqa: E402
from lmiserve.models.load import load_causal_lm  # noqa: E402

model = load_causal_lm(build_tiny_model_dir(Path(tempfile.mkdtemp()) / "tiny"), dtype="fp32", device="cpu")
from lmiserve.engine.attention import cpu_kernel  # noqa: E402

cpu_kernel.available = lambda dtype, device: False  # a GPU's torch attention, not the CPU's compiled kernel
for path, backend in [("fast", "triton"), ("fast", "torch"), ("generic", "triton"), ("generic", "torch")]:
    os.environ["LMISERVE_ATTENTION_BACKEND"] = backend
    owner, name = (FastLlama, "forward") if path == "fast" else (PagedGenericRunner, "_forward")
    forward = getattr(owner, name)
    hazards, calls = ch.Hazards(), []

    def watched(self, *args, _forward=forward, _hazards=hazards, _calls=calls):
        _calls.append(1)
        return ch.watch(_hazards, _forward, self, *args)

    setattr(owner, name, watched)
    asyncio.run(serve_prompts(model, EngineConfig(fast_path=path == "fast", max_prefill_tokens=8), 6))
    setattr(owner, name, forward)
    waits = hazards.syncs
    print(
        f"{path} forward, {backend} attention: {len(calls)} forwards, {len(waits)} host waits "
        f"({len(waits) / len(calls):.2f} a forward): {dict(collections.Counter(waits))}"
    )
