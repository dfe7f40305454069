"""How often a vision-language model's step makes the host wait for the device (a blocking copy to it, a
value read back), counted on a CPU with tests/helpers/capture_hazards.py (issue #39, 2026-11-30).

Run from a checkout's root (one that has the helper: `12d3f94` on, for the figures before):

    PYTHONPATH=. python benchmarks/results/issue39-vlm-waits-2026-11-30/count_vlm_waits.py [FAMILY ...]

Each family's tiny random VLM (tests/helpers/tiny_vlm.py), three requests (two with an image, one text)
served together with prompt chunks of 8 tokens (a chunk boundary inside an image), the torch attention
over the gathered blocks (a GPU's without Triton; the CPU's compiled kernel is left out). Watched: each
step's forward (`PagedGenericRunner._forward`: the vision runner's inputs, positions and mask, then
transformers' forward of the language model) and each request's image encoding at admission
(`PagedVisionRunner._encode`, transformers' encoder included). Each wait is named by its line: lmiserve's
own, or transformers'.
"""

import asyncio
import collections
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "tests")

from helpers import capture_hazards as ch  # noqa: E402
from helpers.tiny_vlm import FAMILIES, TinyVlmDirs  # noqa: E402
from helpers.vlm_serving import chat, config, image_of, prompt_of, serve  # noqa: E402
from lmiserve.engine.attention import cpu_kernel  # noqa: E402
from lmiserve.engine.runner.generic import PagedGenericRunner  # noqa: E402
from lmiserve.engine.runner.vision import PagedVisionRunner  # noqa: E402
from lmiserve.models.load import load_causal_lm  # noqa: E402

os.environ["LMISERVE_ATTENTION_BACKEND"] = "torch"
cpu_kernel.available = lambda dtype, device: False  # a GPU's torch attention, not the CPU's compiled kernel
dirs = TinyVlmDirs(Path(tempfile.mkdtemp()))


OURS = {path.name for path in Path("lmiserve").rglob("*.py")}  # the helper names a line by its file's name


def ours(where: str) -> bool:
    return where.split(":")[0] in OURS


for family in sys.argv[1:] or FAMILIES:
    loaded = load_causal_lm(dirs[family], dtype="fp32", device="cpu")
    counted = {}
    originals = {}
    for owner, name in ((PagedGenericRunner, "_forward"), (PagedVisionRunner, "_encode")):
        original = originals[name] = getattr(owner, name)
        hazards, calls = ch.Hazards(), []
        counted[name] = (hazards, calls)

        def watched(self, *args, _original=original, _hazards=hazards, _calls=calls):
            _calls.append(1)
            return ch.watch(_hazards, _original, self, *args)

        setattr(owner, name, watched)
    requests = [
        (prompt_of(loaded, chat("Describe the picture.")), (image_of(1),)),
        (prompt_of(loaded, [{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}]), ()),
        (prompt_of(loaded, chat("What colour is it?")), (image_of(2, (40, 56)),)),
    ]
    results, _ = asyncio.run(serve(loaded, config(max_prefill_tokens=8), requests))
    for owner, name in ((PagedGenericRunner, "_forward"), (PagedVisionRunner, "_encode")):
        setattr(owner, name, originals[name])
    for name, (hazards, calls) in counted.items():
        waits = hazards.syncs
        mine = [w for w in waits if ours(w[1])]
        print(
            f"{family} {name}: {len(calls)} calls, {len(waits)} host waits ({len(waits) / max(len(calls), 1):.2f} a"
            f" call), lmiserve's {len(mine)} ({len(mine) / max(len(calls), 1):.2f} a call): "
            f"{dict(collections.Counter(waits))}"
        )
