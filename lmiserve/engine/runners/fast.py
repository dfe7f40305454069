"""The fast strategy (default where supported): lmiserve's own Llama-family forward
(engine/fast_llama.py) over the slot cache. A whole step -- all decode rows and every prefill chunk
-- runs as ONE ragged forward pass. If that pass raises, its parts are re-run one by one so only
the culprit fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmiserve.engine import autotune as kernel_autotune
from lmiserve.engine.fast_llama import FastLlama
from lmiserve.engine.kv_cache import SlotKVCache
from lmiserve.engine.paged_attention import PagedKVCache
from lmiserve.engine.runners.base import ModelRunner, slot_cache, slot_of
from lmiserve.engine.scheduler import PrefillChunk, StepPlan
from lmiserve.engine.sequence import Sequence
from lmiserve.engine.step import StepOutput

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusedStep:
    """The model work of one fused forward: decode rows (slot order, one token each), then each
    prefill chunk's tokens."""

    decode: list[Sequence]
    chunks: list[PrefillChunk]

    @property
    def seqs(self) -> list[Sequence]:
        return self.decode + [chunk.seq for chunk in self.chunks]

    def parts(self) -> list[FusedStep]:
        """The step split into parts that fail alone: all decode rows together, then each chunk."""
        parts = [FusedStep(self.decode, [])] if self.decode else []
        return parts + [FusedStep([], [chunk]) for chunk in self.chunks]


class FastRunner(ModelRunner):
    path = "fast"

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_slots: int,
        max_context: int,
        eos_token_ids: Iterable[int],
        autotune: bool = False,
        autotune_cache: str | None = None,
        kv: PagedKVCache | None = None,
    ) -> None:
        """`autotune`: time the CPU kernel choices at start-up (or read them from `autotune_cache`,
        engine/autotune.py); otherwise the static defaults. `kv`: run over this paged cache (the block
        scheduler's plans, runners/paged.py) instead of a slot cache of `max_slots` slots."""
        super().__init__(model, max_slots=max_slots, max_context=max_context, eos_token_ids=eos_token_ids)
        cache: SlotKVCache | PagedKVCache
        if kv is None:
            cache = self.cache = slot_cache(model, max_slots, max_context)
        else:
            cache = kv
        self.fast = FastLlama(model, cache, max_context)
        if autotune:
            start = time.monotonic()
            self.kernels = kernel_autotune.choose(self.fast, max_slots, autotune_cache)
            log.info("CPU kernels (%.1f s): %s", time.monotonic() - start, self.kernels.describe())
        else:
            self.kernels = kernel_autotune.KernelChoice(self.fast.gemm, self.fast.compiled_attention, "static")

    def _run(self, plan: StepPlan, out: StepOutput) -> None:
        step = FusedStep(plan.decode, plan.prefill)
        if not step.decode and not step.chunks:
            return
        try:
            logits = self._forward(step)
        except Exception:  # noqa: BLE001 - find the culprit: each part alone, each failing alone
            parts = step.parts()
            log.exception("fused step of %d part(s) failed; re-running them one by one", len(parts))
            for part in parts:
                self._guard(part.seqs, out, self._run_alone, part, out)
            return
        self._finish(step, logits, out)

    def _run_alone(self, part: FusedStep, out: StepOutput) -> None:
        self._finish(part, self._forward(part), out)

    def _forward(self, step: FusedStep) -> torch.Tensor:
        """The kept logits rows of the step: one per decode row, then per chunk every row (prompt
        logprobs asked) or the last (the chunk completes its prompt) or none."""
        decode = step.decode
        keep = list(range(len(decode)))
        offset = len(decode)
        prefills = []
        for chunk in step.chunks:
            seq, start, length = chunk.seq, chunk.start, chunk.length
            prefills.append((self._where(seq), start, chunk.token_ids))
            if seq.params.decoder_input_details:
                keep.extend(range(offset, offset + length))
            elif chunk.completes_prompt:
                keep.append(offset + length - 1)
            offset += length
        ids, positions = [s.output_ids[-1] for s in decode], [s.kv_len for s in decode]
        return self.fast.forward(ids, positions, prefills, keep, decode_tables=self._decode_tables(decode))

    def _where(self, seq: Sequence) -> Any:
        """Where the sequence's KV is: its slot (a paged runner: its block table)."""
        return slot_of(seq)

    def _decode_tables(self, decode: list[Sequence]) -> list[list[int]] | None:
        """The decode rows' block tables (None: slot rows 0..R-1)."""
        return None

    def _finish(self, step: FusedStep, logits: torch.Tensor, out: StepOutput) -> None:
        """Sample (and record prompt logprobs) from the kept logits rows, in `_forward`'s order. Every
        row that samples is sampled in one `_sample_rows` (one bitmask for the step's constrained rows)."""
        sampling = list(step.decode)
        rows = list(range(len(step.decode)))
        row = len(step.decode)
        for chunk in step.chunks:
            count = chunk.length if chunk.seq.params.decoder_input_details else int(chunk.completes_prompt)
            if count:
                self._guard([chunk.seq], out, self._finish_chunk, chunk, logits[row : row + count], out, sample=False)
                if chunk.completes_prompt and chunk.seq.seq_id not in out.errors:
                    sampling.append(chunk.seq)
                    rows.append(row + count - 1)
            row += count
        if sampling:
            self._sample_rows(sampling, logits if rows == list(range(len(logits))) else logits[rows], out)
