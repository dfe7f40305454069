"""What every model runner shares: the interface the engine calls, sampling, prompt logprobs and the
failure isolation that keeps one sequence's error away from the others.

A runner executes the model work of one scheduler step (a `StepPlan`) and returns what it computed
(a `StepOutput`). A forward pass or a sampler that raises ends only the sequences it was computing:
their `StepOutput.errors` say why, the engine goes on. Each sequence that samples owns a
`torch.Generator` seeded from its seed, kept here until the sequence leaves the batch.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar, ParamSpec

import torch

from lmiserve.engine.kv_cache import AttentionShape, SlotKVCache
from lmiserve.engine.paged_attention import PagedKVCache
from lmiserve.engine.prefix_store import PrefixStore, bytes_per_token
from lmiserve.engine.sampling import Row, make_generator, sample_rows
from lmiserve.engine.scheduler import PrefillChunk, StepPlan
from lmiserve.engine.sequence import Sequence
from lmiserve.engine.step import PromptScores, StepOutput
from lmiserve.engine.token_mask import TokenMask

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from lmiserve.core.request import SamplingParams

log = logging.getLogger(__name__)

_P = ParamSpec("_P")


class ModelRunner(ABC):
    """Runs scheduler plans on one model. Subclasses implement `_run` (one per strategy)."""

    path: ClassVar[str]  # the strategy: "fast", "generic" or "batch_invariant"
    # a paged runner (runners/paged.py): the blocks of its KV pool, their size in tokens and the pool's bytes
    num_blocks: int | None = None
    block_size: int = 16
    kv_bytes: int = 0

    def __init__(
        self, model: PreTrainedModel, *, max_slots: int, max_context: int, eos_token_ids: Iterable[int]
    ) -> None:
        self.model = model
        self.device = model.device
        self.eos_token_ids = sorted(eos_token_ids)
        self._generators: dict[int, torch.Generator] = {}  # seq_id -> its sampler's generator
        self._mask: TokenMask | None = None  # made on the first step with a constrained row
        self.cache: SlotKVCache | None = None  # the slot cache, for the strategies that have one
        self.prefix_store: PrefixStore | None = None

    # ---- prefix cache ------------------------------------------------------------------------------
    def enable_prefix_cache(self, max_bytes: int, block_size: int) -> int:
        """Make the prefix cache's pool (at most `max_bytes`); its number of blocks, 0 when this runner
        has none (no slot cache, or not one block fits)."""
        if self.cache is None:
            return 0
        blocks = max_bytes // (bytes_per_token(self.cache) * block_size)
        if blocks < 1:
            return 0
        self.prefix_store = PrefixStore(self.cache, int(blocks), block_size)
        return int(blocks)

    def _prepare_slots(self, plan: StepPlan, out: StepOutput) -> StepPlan:
        """Apply the plan's prefix cache saves and slot moves in their order, then its prefix loads. If
        a copy fails the cache is dropped (`out.prefix_failed`) and the sequences that were to start
        from it fail; the plan without their prefill chunks is returned."""
        cache, store = self.cache, self.prefix_store
        if cache is None:
            return plan
        saves = sorted(plan.saves, key=lambda save: save.before_move)
        try:
            for number, move in enumerate([*plan.moves, None]):
                while saves and saves[0].before_move <= number:
                    save = saves.pop(0)
                    if store is not None:
                        store.save(save.slot, save.blocks)
                if move is not None:
                    cache.move_slot(*move)
        except Exception:  # noqa: BLE001 - the cache is dropped; the requests that needed it fail below
            log.exception("copying into the prefix cache failed; dropping it")
            out.prefix_failed = True
        for load in plan.loads:
            seq = load.seq
            if out.prefix_failed or store is None:
                out.errors[seq.seq_id] = "exception occurred during generation: the prefix cache failed"
                continue
            self._guard([seq], out, store.load, load.slot, load.match.blocks, load.match.tokens)
        if not out.errors:
            return plan
        return dataclasses.replace(plan, prefill=[c for c in plan.prefill if c.seq.seq_id not in out.errors])

    # ---- one step ----------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run `plan` (slot moves, released sequences, decode rows, prefill chunks) on the model."""
        with torch.inference_mode():
            for seq in plan.released:
                self._release(seq)
            out = StepOutput()
            self._run(self._prepare_slots(plan, out), out)
            return out

    @abstractmethod
    def _run(self, plan: StepPlan, out: StepOutput) -> None:
        """Move slots as planned, run the plan's decode rows and prefill chunks, fill `out`."""

    def _release(self, seq: Sequence) -> None:
        """Forget what this runner keeps for a sequence that left the batch."""
        self._generators.pop(seq.seq_id, None)

    # ---- failure isolation -------------------------------------------------------------------------
    def _guard(
        self, seqs: list[Sequence], out: StepOutput, fn: Callable[_P, None], *args: _P.args, **kwargs: _P.kwargs
    ) -> None:
        """Run `fn`; if it raises, the sequences it was computing end with the error; the engine goes on."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported to those requests, logged here
            log.exception("model step failed for %d sequence(s)", len(seqs))
            for seq in seqs:
                out.errors[seq.seq_id] = f"exception occurred during generation: {exc}"

    # ---- results of a forward pass -----------------------------------------------------------------
    def _finish_chunk(self, chunk: PrefillChunk, rows: torch.Tensor, out: StepOutput, *, sample: bool = True) -> None:
        """Record the chunk's prompt logprobs (when asked) and sample the first token after a complete
        prompt (unless `sample` is False: the caller samples it with others). `rows` are the chunk's
        logits rows: all of them with prompt logprobs, else the last."""
        seq = chunk.seq
        if seq.params.decoder_input_details:
            out.prompt_logprobs[seq.seq_id] = prompt_logprobs(
                rows, seq.prompt_ids, chunk.start, chunk.start + chunk.length, seq.params.prompt_top_n
            )
        if chunk.completes_prompt and sample:
            self._sample_rows([seq], rows[-1:], out)

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor, out: StepOutput) -> None:
        """Sample each sequence from its row of `logits` ([len(seqs), vocab]). The rows of sequences
        that carry a grammar are masked first, all with one bitmask; the other rows are not touched."""
        masked: dict[int, torch.Tensor] = {}
        constrained = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if constrained:
            group = [seqs[i] for i in constrained]
            self._guard(group, out, self._mask_rows, group, logits, constrained, masked)
        rows, specs = [], []
        for row, seq in enumerate(seqs):
            if seq.seq_id in out.errors:
                continue
            try:
                specs.append(self._row(seq, logits.device, masked.get(row)))
                rows.append(row)
            except Exception as exc:  # noqa: BLE001 - one sequence fails, the batch goes on
                self._sampling_failed(seq, exc, out)
        if not rows:
            return
        try:
            results = sample_rows(logits if len(rows) == len(logits) else logits[rows], specs)
        except Exception as exc:  # noqa: BLE001 - the step's rows fail, the engine goes on
            for row in rows:
                self._sampling_failed(seqs[row], exc, out)
            return
        for row, result in zip(rows, results):
            if isinstance(result, Exception):
                self._sampling_failed(seqs[row], result, out)
            else:
                out.samples[seqs[row].seq_id] = [result]

    def _mask_rows(
        self, seqs: list[Sequence], logits: torch.Tensor, rows: list[int], masked: dict[int, torch.Tensor]
    ) -> None:
        """Masked copies of `logits[rows]` (the rows of `seqs`, which carry grammars) into `masked`."""
        if self._mask is None:
            self._mask = TokenMask(logits.shape[-1], self.eos_token_ids)
        copies = logits[rows]  # advanced indexing: a copy; the raw rows stay for the logprobs
        self._mask.apply(copies, [seq.grammar for seq in seqs if seq.grammar is not None])
        masked.update(zip(rows, copies))

    def _row(self, seq: Sequence, device: torch.device, masked: torch.Tensor | None) -> Row:
        """What the sampler needs of `seq` (its generator made on its first sampled token)."""
        row = sampler_row(
            seq.params,
            seq.prompt_ids,
            seq.output_ids,
            self.eos_token_ids,
            seq.seed,
            self._generators.get(seq.seq_id),
            device,
        )
        if row.generator is not None:
            self._generators[seq.seq_id] = row.generator
        row.masked = masked
        return row

    @staticmethod
    def _sampling_failed(seq: Sequence, exc: Exception, out: StepOutput) -> None:
        log.error("sampling failed for %s: %s", seq.request_id, exc, extra={"request_id": seq.request_id})
        out.errors[seq.seq_id] = f"exception occurred during sampling: {exc}"


def sampler_row(
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    eos_token_ids: list[int],
    seed: int | None,
    generator: torch.Generator | None,
    device: torch.device | None = None,
) -> Row:
    """What the sampler needs of one sequence: `min_new_tokens` bans the EOS and stop ids; a sampled
    sequence's generator is made from its seed on its first token (`Row.generator`, for the caller to
    keep) on `device`."""
    if params.do_sample and generator is None:
        if seed is None:
            raise ValueError("a sampled sequence needs a seed")
        generator = make_generator(seed, device if device is not None else torch.device("cpu"))
    banned = eos_token_ids + params.stop_token_ids if params.min_new_tokens else []
    return Row(params, prompt_ids, output_ids, banned, generator)


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: list[int], start: int, end: int, top_n: int | None = None
) -> PromptScores:
    """Logprob of each prompt token given the ones before it, from the logits rows of prompt positions
    ``start..end-1``; the first prompt token has none. With `top_n` (not None) also each token's rank (1 +
    the number of tokens the model found more likely) and the `top_n` most likely tokens at its position."""
    targets = prompt_ids[start + 1 : min(end + 1, len(prompt_ids))]
    logprobs = logits[: len(targets)].log_softmax(-1)
    chosen = logprobs[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)]
    values: list[float | None] = chosen.tolist()
    ranks: list[int | None] | None = None
    tops: list[list[tuple[int, float]] | None] | None = None
    if top_n is not None:
        ranks = ((logprobs > chosen[:, None]).sum(-1) + 1).tolist()
        best, ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]))
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), best.tolist())]
    if start == 0:
        return PromptScores(
            0, [None, *values], None if ranks is None else [None, *ranks], None if tops is None else [None, *tops]
        )
    return PromptScores(start + 1, values, ranks, tops)


def slot_cache(model: PreTrainedModel, max_slots: int, max_context: int) -> SlotKVCache:
    """A `SlotKVCache` of `max_slots` slots shaped for `model`'s attention layers."""
    shape = AttentionShape.of(model.config)
    return SlotKVCache(
        shape.layers,
        max_slots,
        shape.kv_heads,
        shape.head_dim,
        model.dtype,
        model.device,
        initial_len=min(128, max_context),
        max_len=max_context,
    )


def paged_cache(model: PreTrainedModel, num_blocks: int, block_size: int) -> PagedKVCache:
    """A `PagedKVCache` of `num_blocks` blocks of `block_size` tokens shaped for `model`'s attention layers."""
    shape = AttentionShape.of(model.config)
    return PagedKVCache(shape.layers, num_blocks, block_size, shape.kv_heads, shape.head_dim, model.dtype, model.device)


def model_forward(
    model: PreTrainedModel,
    device: torch.device,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: SlotKVCache | DynamicCache,
    logits_to_keep: int,
) -> torch.Tensor:
    """One transformers forward pass over `cache`; the logits of the last `logits_to_keep` positions
    (0 = all). Inputs are moved to `device` (the model's)."""
    result = model(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=attention_mask.to(device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    logits: torch.Tensor = result.logits
    return logits


def slot_of(seq: Sequence) -> int:
    """The cache slot of a sequence in the running batch."""
    if seq.slot is None:
        raise RuntimeError(f"sequence {seq.seq_id} holds no cache slot")
    return seq.slot
