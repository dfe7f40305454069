"""Model runners: how a scheduler step runs on the model, one class per strategy.

- fast (`FastRunner`, default where supported): every running sequence owns a slot of one
  preallocated `SlotKVCache`; a whole step runs as ONE ragged forward pass of lmiserve's own
  Llama-family decoder over the loaded weights.
- generic (`GenericRunner`: any other architecture, or `fast_path=False`): the same slot cache
  through the transformers model; one decode forward for all rows, one forward per prefill chunk.
- batch-invariant (`BatchInvariantRunner`, `batch_invariant=true`): each sequence runs alone as
  `model.generate` would, so greedy output equals it bit for bit.

`create_runner` picks the strategy from the configuration and the model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lmiserve.engine.llama_layout import unsupported_reason
from lmiserve.engine.runners.base import ModelRunner
from lmiserve.engine.runners.batch_invariant import BatchInvariantRunner
from lmiserve.engine.runners.fast import FastRunner
from lmiserve.engine.runners.generic import GenericRunner

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["BatchInvariantRunner", "FastRunner", "GenericRunner", "ModelRunner", "create_runner", "runner_class"]

log = logging.getLogger(__name__)


def runner_class(
    model: PreTrainedModel, *, batch_invariant: bool, fast_path: bool, paged: bool = False
) -> tuple[type[ModelRunner], str | None]:
    """The strategy for `model`, and why it is not the fast one (None when it is, or when the batch-
    invariant one was asked for); `paged`: over the paged KV cache (which serves sliding windows)."""
    if batch_invariant:
        return BatchInvariantRunner, None
    reason = unsupported_reason(model, windows=paged) if fast_path else "fast_path is off"
    return (FastRunner, None) if reason is None else (GenericRunner, reason)


def create_runner(
    model: PreTrainedModel,
    *,
    max_slots: int,
    max_context: int,
    eos_token_ids: Iterable[int],
    batch_invariant: bool = False,
    fast_path: bool = True,
    autotune: bool = False,
    autotune_cache: str | None = None,
) -> ModelRunner:
    """The runner for `model`; `autotune` (fast path only): time the CPU kernel choices at start-up."""
    cls, reason = runner_class(model, batch_invariant=batch_invariant, fast_path=fast_path)
    log.info("model runner: %s path%s", cls.path, "" if reason is None else f" ({reason})")
    if cls is FastRunner:
        return FastRunner(
            model,
            max_slots=max_slots,
            max_context=max_context,
            eos_token_ids=eos_token_ids,
            autotune=autotune,
            autotune_cache=autotune_cache,
        )
    return cls(model, max_slots=max_slots, max_context=max_context, eos_token_ids=eos_token_ids)
