"""Runs a scheduler plan on a transformers causal LM: prefill chunks, one batched decode, sampling.

Three strategies share this interface:
- fast (default where supported, see engine/fast_llama.py): every running sequence owns a slot of one
  preallocated `SlotKVCache`; a whole step -- all decode rows and every prefill chunk -- runs as ONE
  ragged forward pass of lmiserve's own Llama-family decoder over the loaded weights. If that pass
  raises, its parts are re-run one by one so only the culprit fails.
- generic (any other architecture, or `fast_path=False`): the same slot cache through the
  transformers model; a step decodes all running sequences in one forward pass with per-row
  positions and a padding mask, then prefills each chunk in a forward pass of its own.
- batch-invariant (`batch_invariant=true`): each sequence keeps its own `DynamicCache` and runs its
  own forward passes exactly as `model.generate` does, so greedy output equals it bit for bit
  whatever else runs, at the cost of batching throughput.
"""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache

from lmiserve.engine.fast_llama import FastLlama, unsupported_reason
from lmiserve.engine.kv_cache import SlotKVCache
from lmiserve.engine.sampling import make_generator, sample_row
from lmiserve.engine.scheduler import PrefillChunk, StepOutput, StepPlan
from lmiserve.engine.sequence import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, model, *, max_slots: int, max_context: int, eos_token_ids: set[int], batch_invariant: bool = False,
        fast_path: bool = True,
    ):
        self.model = model
        self.fast: FastLlama | None = None
        self._pending: list = []
        self.device = model.device
        self.batch_invariant = batch_invariant
        self.eos_token_ids = sorted(eos_token_ids)
        cfg = model.config
        if batch_invariant:
            self._caches: dict[int, DynamicCache] = {}
        else:
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            self.cache = SlotKVCache(
                cfg.num_hidden_layers, max_slots, kv_heads, head_dim, model.dtype, self.device,
                initial_len=min(128, max_context), max_len=max_context,
            )
            reason = unsupported_reason(model) if fast_path else "fast_path is off"
            if reason is None:
                self.fast = FastLlama(model, self.cache, max_context)
            log.info("model runner: %s path%s", self.path, "" if reason is None else f" ({reason})")

    @property
    def path(self) -> str:
        """Which forward runs the batch: "fast", "generic" or "batch_invariant"."""
        return "batch_invariant" if self.batch_invariant else "fast" if self.fast is not None else "generic"

    # ---- one step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        out = StepOutput()
        if self.batch_invariant:
            for seq in plan.released:
                self._caches.pop(seq.seq_id, None)
        else:
            for src, dst, length in plan.moves:
                self.cache.move_slot(src, dst, length)
        self._pending = []
        if plan.decode:
            self._guard(plan.decode, out, self._decode, plan.decode, out)
        for chunk in plan.prefill:
            self._guard([chunk.seq], out, self._prefill, chunk, out)
        if self._pending:
            self._run_fused(out)
        return out

    def _guard(self, seqs: list[Sequence], out: StepOutput, fn, *args) -> None:
        """A failing forward pass ends the sequences it was computing; the engine goes on."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported to those requests, logged here
            log.exception("model step failed for %d sequence(s)", len(seqs))
            for seq in seqs:
                out.errors[seq.seq_id] = f"exception occurred during generation: {exc}"

    def _forward(self, input_ids, position_ids, attention_mask, cache, logits_to_keep: int) -> torch.Tensor:
        result = self.model(
            input_ids=input_ids.to(self.device),
            position_ids=position_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return result.logits

    # ---- prefill -----------------------------------------------------------------------------------
    def _prefill(self, chunk: PrefillChunk, out: StepOutput) -> None:
        if self.fast is not None:
            self._pending.append(chunk)  # runs in this step's one fused forward
            return
        seq, start, length = chunk.seq, chunk.start, chunk.length
        end = start + length
        ids = torch.tensor([seq.prompt_ids[start:end]], dtype=torch.long)
        positions = torch.arange(start, end)[None]
        keep = 0 if seq.params.decoder_input_details else 1
        if self.batch_invariant:
            cache = self._caches.setdefault(seq.seq_id, DynamicCache(config=self.model.config))
            mask = torch.ones(1, end, dtype=torch.long)
        else:
            cache = self.cache
            cache.for_prefill(seq.slot, start, length)
            mask = (torch.arange(end)[None, :] <= positions[0, :, None])[None, None]
        logits = self._forward(ids, positions, mask, cache, keep)[0].float()
        if seq.params.decoder_input_details:
            out.prompt_logprobs[seq.seq_id] = _prompt_logprobs(logits, seq.prompt_ids, start, end)
        if chunk.completes_prompt:
            self._sample(seq, logits[-1], out)

    # ---- decode ------------------------------------------------------------------------------------
    def _decode(self, seqs: list[Sequence], out: StepOutput) -> None:
        if self.batch_invariant:
            for seq in seqs:
                self._guard([seq], out, self._decode_alone, seq, out)
            return
        if self.fast is not None:
            self._pending.insert(0, list(seqs))  # decode rows come first in the fused forward
            return
        positions = torch.tensor([s.kv_len for s in seqs])
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], dtype=torch.long)
        self.cache.for_decode(positions)
        span = int(positions.max()) + 1
        mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]
        logits = self._forward(ids, positions[:, None], mask, self.cache, 1)[:, -1].float()
        for row, seq in enumerate(seqs):
            self._guard([seq], out, self._sample, seq, logits[row], out)

    def _decode_alone(self, seq: Sequence, out: StepOutput) -> None:
        cache = self._caches[seq.seq_id]
        ids = torch.tensor([[seq.output_ids[-1]]], dtype=torch.long)
        positions = torch.tensor([[seq.kv_len]])
        mask = torch.ones(1, seq.kv_len + 1, dtype=torch.long)
        logits = self._forward(ids, positions, mask, cache, 1)[0, -1].float()
        self._sample(seq, logits, out)

    # ---- the fused step (fast path) -----------------------------------------------------------------
    def _run_fused(self, out: StepOutput) -> None:
        parts, self._pending = self._pending, []
        try:
            logits = self._fused_forward(parts)
        except Exception:  # noqa: BLE001 - find the culprit: each part alone, each failing alone
            log.exception("fused step of %d part(s) failed; re-running them one by one", len(parts))
            for part in parts:
                seqs = part if isinstance(part, list) else [part.seq]
                self._guard(seqs, out, lambda p=part: self._finish_parts([p], self._fused_forward([p]), out))
            return
        self._finish_parts(parts, logits, out)

    def _fused_forward(self, parts: list) -> torch.Tensor:
        decode: list[Sequence] = next((p for p in parts if isinstance(p, list)), [])
        chunks = [p for p in parts if isinstance(p, PrefillChunk)]
        keep = list(range(len(decode)))
        offset = len(decode)
        prefills = []
        for chunk in chunks:
            seq, start, length = chunk.seq, chunk.start, chunk.length
            prefills.append((seq.slot, start, seq.prompt_ids[start : start + length]))
            if seq.params.decoder_input_details:
                keep.extend(range(offset, offset + length))
            elif chunk.completes_prompt:
                keep.append(offset + length - 1)
            offset += length
        return self.fast.forward(
            [s.output_ids[-1] for s in decode], [s.kv_len for s in decode], prefills, keep
        )

    def _finish_parts(self, parts: list, logits: torch.Tensor, out: StepOutput) -> None:
        """Sample (and record prompt logprobs) from the kept logits rows, in `_fused_forward` order."""
        row = 0
        for part in parts:
            if isinstance(part, list):
                for seq in part:
                    self._guard([seq], out, self._sample, seq, logits[row], out)
                    row += 1
        for part in parts:
            if isinstance(part, list):
                continue
            count = part.length if part.seq.params.decoder_input_details else int(part.completes_prompt)
            if count:
                self._guard([part.seq], out, self._finish_chunk, part, logits[row : row + count], out)
            row += count

    def _finish_chunk(self, chunk: PrefillChunk, rows: torch.Tensor, out: StepOutput) -> None:
        seq = chunk.seq
        if seq.params.decoder_input_details:
            out.prompt_logprobs[seq.seq_id] = _prompt_logprobs(rows, seq.prompt_ids, chunk.start, chunk.start + chunk.length)
        if chunk.completes_prompt:
            self._sample(seq, rows[-1], out)

    # ---- sampling ----------------------------------------------------------------------------------
    def _sample(self, seq: Sequence, logits: torch.Tensor, out: StepOutput) -> None:
        try:
            if seq.params.do_sample and seq.sampler_state is None:
                seq.sampler_state = make_generator(seq.seed, logits.device)
            banned = self.eos_token_ids + seq.params.stop_token_ids if seq.params.min_new_tokens else []
            out.samples[seq.seq_id] = sample_row(
                logits, seq.params, seq.prompt_ids, seq.output_ids, banned, seq.sampler_state
            )
        except Exception as exc:  # noqa: BLE001 - one sequence fails, the batch goes on
            log.exception("sampling failed for %s", seq.request_id)
            out.errors[seq.seq_id] = f"exception occurred during sampling: {exc}"


def _prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], start: int, end: int) -> tuple[int, list]:
    """Logprob of each prompt token given the ones before it; the first prompt token has none."""
    targets = prompt_ids[start + 1 : min(end + 1, len(prompt_ids))]
    logprobs = logits[: len(targets)].log_softmax(-1)
    values = logprobs[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)].tolist()
    return (0, [None, *values]) if start == 0 else (start + 1, values)
