"""The generic strategy: any causal LM through its own transformers forward, over the slot cache.

A step decodes all running sequences in one forward pass (per-row positions and a padding mask),
then prefills each chunk in a forward pass of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from lmiserve.engine.kv_cache import SlotKVCache
from lmiserve.engine.runners.base import ModelRunner, model_forward, slot_cache, slot_of
from lmiserve.engine.scheduler import PrefillChunk, StepPlan
from lmiserve.engine.sequence import Sequence
from lmiserve.engine.step import StepOutput

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class GenericRunner(ModelRunner):
    path = "generic"
    cache: SlotKVCache

    def __init__(
        self, model: PreTrainedModel, *, max_slots: int, max_context: int, eos_token_ids: Iterable[int]
    ) -> None:
        super().__init__(model, max_slots=max_slots, max_context=max_context, eos_token_ids=eos_token_ids)
        self.cache = slot_cache(model, max_slots, max_context)

    def _run(self, plan: StepPlan, out: StepOutput) -> None:
        if plan.decode:
            self._guard(plan.decode, out, self._decode, plan.decode, out)
        for chunk in plan.prefill:
            self._guard([chunk.seq], out, self._prefill, chunk, out)

    def _decode(self, seqs: list[Sequence], out: StepOutput) -> None:
        positions = torch.tensor([s.kv_len for s in seqs])
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], dtype=torch.long)
        self.cache.for_decode(positions)
        span = int(positions.max()) + 1
        mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]
        logits = model_forward(self.model, self.device, ids, positions[:, None], mask, self.cache, 1)[:, -1].float()
        self._sample_rows(seqs, logits, out)

    def _prefill(self, chunk: PrefillChunk, out: StepOutput) -> None:
        seq, start, length = chunk.seq, chunk.start, chunk.length
        end = start + length
        ids = torch.tensor([seq.prompt_ids[start:end]], dtype=torch.long)
        positions = torch.arange(start, end)[None]
        keep = 0 if seq.params.decoder_input_details else 1
        self.cache.for_prefill(slot_of(seq), start, length)
        mask = (torch.arange(end)[None, :] <= positions[0, :, None])[None, None]
        logits = model_forward(self.model, self.device, ids, positions, mask, self.cache, keep)[0].float()
        self._finish_chunk(chunk, logits, out)
