"""Model runners: how a step's plain-data batch (engine/core/step.py) runs on the model, over the paged KV pool.

- fast (`PagedFastRunner`, runner/fast.py; default where supported): lmiserve's own Llama-family forward
  (engine/model/fast_llama.py), the whole step as ONE ragged forward pass.
- generic (`PagedGenericRunner`, runner/generic.py: any other architecture, or `fast_path=False`):
  the transformers model's own forward, its attention over the same blocks.
- batch-invariant (`PagedGenericRunner(alone=True)`, `batch_invariant=true`): each row runs alone through
  the transformers model, its prompt whole, as `model.generate` would, so greedy output equals it bit for
  bit whatever else runs.

Both keep the persistent batch of runner/persistent_batch.py; `fast_reason` says whether the fast one serves a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmiserve.engine.lora.adapters import ATTENTION_MODULES, FAST_PATH_MODULES
from lmiserve.engine.model.layout_variants import MOE_TYPES
from lmiserve.engine.model.llama_layout import unsupported_reason

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["fast_path_modules", "fast_reason"]


def fast_reason(model: PreTrainedModel, *, fast_path: bool, lora: bool = False) -> str | None:
    """Why lmiserve's own forward does not serve `model` (None: it does); `lora`: whether adapters are configured
    (lmiserve's forward applies them to attention's and dense MLPs' linears, not to a mixture of experts: there
    transformers' forward, which hooks any linear, serves them; where it cannot run the model, gpt-oss's sinks,
    lmiserve's forward serves adapters of its attention alone: `fast_path_modules`)."""
    if not fast_path:
        return "fast_path is off"
    reason = unsupported_reason(model)
    if reason is None and lora and model.config.model_type in MOE_TYPES:
        from lmiserve.engine.runner import generic

        return "LoRA adapters on a mixture of experts" if generic.unsupported_reason(model) is None else None
    return reason


def fast_path_modules(model: PreTrainedModel) -> tuple[str, ...]:
    """The linears lmiserve's forward adapts in `model` (a mixture of experts: its attention's alone, not its
    experts' or shared experts'; a vision-language model: its decoder's)."""
    return ATTENTION_MODULES if model.config.get_text_config().model_type in MOE_TYPES else FAST_PATH_MODULES
