"""A GPU step's sampled rows drawn in one Triton kernel, each from its own seed (issue #39: the host side of
a step).

`sampling._draw` draws a row as `torch.multinomial` draws one token: an exponential variate a token from the
row's `torch.Generator`, the probabilities divided by them, the argmax. A generator fills one tensor a
call, so a step of 128 sampled rows launched 128 kernels before its first shared one, each paid on the host
(a Python call and a launch, several microseconds) while the GPU waited: on a GPU the sampled rows' launches
grew with the rows when everything else of the step no longer did.

Here the variates come from Philox (Triton's `tl.philox`, the counter-based generator torch's CUDA generator
is built on), keyed by what identifies a draw: the sequence's seed, the index of the token being drawn
(how many the sequence has generated) and the token id. So every row of a step is drawn in one launch, and
a draw does not depend on the step it is in: a seeded request samples the same tokens alone, in any batch,
with drafts or not, after a preemption (its tokens so far are kept, so the index is the same). The
variates are not torch's, so a seed draws other tokens on a GPU than on a CPU (which was already so:
torch's CPU and CUDA generators differ).

The vocabulary is cut into parts so that the GPU's SMs all work at a few rows too: each program takes one
row's part, keeps its best score and where, and the sum and least of its probabilities; the parts' winners
and the row's validity (`sampling._draw`'s: the sum above 0 and finite, no value below 0) are a few torch
ops on the device. No value reaches the host: the tokens go out with the step's one transfer.

Used on CUDA where Triton imports (`usable`); a kernel that fails (a Triton that cannot compile it) is
logged once and the step's rows are drawn by `sampling._draw` from then on. Tests:
tests/unit/test_seeded_draw.py (Triton's interpreter on a CPU; on the GPU check's engine tests compiled).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch

from lmiserve.engine.host_copy import to_device

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

__all__ = ["USE_ON_CUDA", "draw", "draw_keyed", "seed_keys", "usable"]

log = logging.getLogger(__name__)

USE_ON_CUDA = True  # False: a GPU's sampled rows are drawn by `sampling._draw`, each its own launches
BLOCK = 1024  # tokens a program reads at a time
_PROGRAMS = 512  # about the programs a step's draw wants in flight (rows x parts), a few per SM
_failed: set[str] = set()  # devices where the kernel failed: `sampling._draw` there


def usable(device: torch.device) -> bool:
    """Whether a step's sampled rows on `device` are drawn by the kernel."""
    return triton is not None and USE_ON_CUDA and device.type == "cuda" and str(device) not in _failed


def draw(probs: torch.Tensor, seeds: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token of each row of `probs` (``[rows, vocab]``, float32) drawn from the row's `seeds` at the
    index `counts` (the tokens the row's sequence has generated), and whether the row could not be drawn
    from; both on the device, as `sampling._draw` returns them. None where the kernel failed (logged once):
    the caller draws otherwise."""
    try:
        return draw_keyed(probs, to_device(seed_keys(seeds), probs.device), to_device(counts, probs.device))
    except Exception:  # noqa: BLE001 - a Triton that cannot build the kernel costs launches, not the rows
        log.exception("the sampled rows' draw kernel failed on %s; drawing each row with its generator", probs.device)
        _failed.add(str(probs.device))
        return None


def seed_keys(seeds: list[int]) -> list[int]:
    """The kernel's key of each seed: taken modulo 2**64 (as `torch.Generator.manual_seed`), as int64's bits."""
    return [(s % 2**64) - (2**64 if s % 2**64 >= 2**63 else 0) for s in seeds]


def draw_keyed(probs: torch.Tensor, keys: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw` from the rows' keys (`seed_keys`) and indexes already on the device, raising where the kernel
    fails: nothing here reads the host (a decode graph captures it, runner/graph_sampling.py)."""
    rows, vocab = probs.shape
    block = min(BLOCK, max(16, triton.next_power_of_2(vocab)))  # (four quarters of 4 tokens at least)
    parts = max(1, min(math.ceil(vocab / block), _PROGRAMS // rows))
    span = math.ceil(math.ceil(vocab / parts) / block) * block  # whole blocks a part
    parts = math.ceil(vocab / span)
    device = probs.device
    best = torch.empty(rows, parts, dtype=torch.float32, device=device)
    where = torch.empty(rows, parts, dtype=torch.int64, device=device)
    total = torch.empty(rows, parts, dtype=torch.float32, device=device)
    least = torch.empty(rows, parts, dtype=torch.float32, device=device)
    probs = probs.contiguous()
    _kernel()[(rows, parts)](probs, keys, index, best, where, total, least, vocab, span, BLOCK=block)
    tokens = where.gather(1, best.argmax(-1, keepdim=True))[:, 0]
    sums = total.sum(-1)
    valid = (sums > 0) & (sums < float("inf")) & (least.amin(-1) >= 0)
    return tokens, ~valid


@functools.cache
def _kernel() -> Any:
    from lmiserve.engine.runner import seeded_draw_kernel

    return triton.jit(seeded_draw_kernel.draw_kernel, do_not_specialize=["vocab", "span"])
