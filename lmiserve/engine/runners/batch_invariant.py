"""The batch-invariant strategy: each sequence keeps its own `DynamicCache` and runs its own forward
passes exactly as `model.generate` does, so greedy output equals it bit for bit whatever else runs,
at the cost of batching throughput. Prompts are prefilled whole (the scheduler does not chunk them).

No prefix cache: KV copied from another request was computed by a forward pass of another shape (a
longer prompt, chunked), so a prompt that starts from it may round differently from `model.generate`,
which is the one thing this strategy promises not to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from lmiserve.engine.runners.base import ModelRunner, model_forward
from lmiserve.engine.scheduler import PrefillChunk, StepPlan
from lmiserve.engine.sequence import Sequence
from lmiserve.engine.step import StepOutput

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class BatchInvariantRunner(ModelRunner):
    path = "batch_invariant"

    def __init__(
        self, model: PreTrainedModel, *, max_slots: int, max_context: int, eos_token_ids: Iterable[int]
    ) -> None:
        super().__init__(model, max_slots=max_slots, max_context=max_context, eos_token_ids=eos_token_ids)
        self._caches: dict[int, DynamicCache] = {}  # seq_id -> its own cache

    def _release(self, seq: Sequence) -> None:
        super()._release(seq)
        self._caches.pop(seq.seq_id, None)

    def _run(self, plan: StepPlan, out: StepOutput) -> None:
        for seq in plan.decode:
            self._guard([seq], out, self._decode, seq, out)
        for chunk in plan.prefill:
            self._guard([chunk.seq], out, self._prefill, chunk, out)

    def _decode(self, seq: Sequence, out: StepOutput) -> None:
        cache = self._caches[seq.seq_id]
        ids = torch.tensor([[seq.output_ids[-1]]], dtype=torch.long)
        positions = torch.tensor([[seq.kv_len]])
        mask = torch.ones(1, seq.kv_len + 1, dtype=torch.long)
        logits = model_forward(self.model, self.device, ids, positions, mask, cache, 1)[0, -1:].float()
        self._sample_rows([seq], logits, out)

    def _prefill(self, chunk: PrefillChunk, out: StepOutput) -> None:
        seq, start, length = chunk.seq, chunk.start, chunk.length
        end = start + length
        ids = torch.tensor([seq.prompt_ids[start:end]], dtype=torch.long)
        positions = torch.arange(start, end)[None]
        keep = 0 if seq.params.decoder_input_details else 1
        cache = self._caches.setdefault(seq.seq_id, DynamicCache(config=self.model.config))
        mask = torch.ones(1, end, dtype=torch.long)
        logits = model_forward(self.model, self.device, ids, positions, mask, cache, keep)[0].float()
        self._finish_chunk(chunk, logits, out)
