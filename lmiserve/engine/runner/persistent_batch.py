"""The persistent batch of a runner that executes the step contract's plain-data batches
(engine/core/step.py): for each request it was told of, its prompt, sampled tokens, parameters, generator
and block table, updated by each batch's difference and forgotten when the request is finished; a
batch's rows run as one forward (a subclass's `_forward_rows`), then every sampling row is sampled
together. A forward that raises is run again in parts (the decode rows together, each chunk alone), so
only the culprit fails. The rows a decode graph's pick does not serve go to the eager sampler
(runner/eager_sampling.py).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lmiserve.engine.attention.paged import PagedKVCache
    from lmiserve.engine.lora.manager import LoraManager

from lmiserve.engine.attention.windows import text_config
from lmiserve.engine.core.step import (
    PENDING_TOKEN,
    AdapterRef,
    BatchRunner,
    Launched,
    ScheduledTokens,
    StepBatch,
    StepOutput,
)
from lmiserve.engine.lora.batch import LoraBatch, LoraGroup, StackCache
from lmiserve.engine.runner.eager_sampling import EagerSampling
from lmiserve.engine.runner.in_flight import StepsInFlight
from lmiserve.engine.runner.penalties import PenaltyBook
from lmiserve.engine.runner.request_state import RequestState
from lmiserve.engine.runner.sampling import banned_ids, greedy_pick, prompt_logprobs
from lmiserve.engine.speculative.proposers import Proposer
from lmiserve.engine.text.images import ImageInputs

log = logging.getLogger(__name__)


class PersistentBatchRunner(EagerSampling, BatchRunner):
    """`execute_batch` over a persistent batch; subclasses compute a part of a batch's rows
    (`_forward_rows`)."""

    path: str  # the strategy, for the log: "fast", "generic" or "batch_invariant"

    def __init__(
        self, model: PreTrainedModel, eos_token_ids: Iterable[int], kv: PagedKVCache, num_blocks: int | None = None
    ) -> None:
        """Run `model` over the block pool `kv`: its shape and memory, an empty persistent batch, and the
        width of `model`'s logits. `num_blocks`: the blocks sequences may hold (default all of `kv`'s;
        fewer where the runner keeps some for itself)."""
        self.model = model
        self.device = model.device
        self.eos_token_ids = sorted(eos_token_ids)
        self.kv = kv
        self.num_blocks, self.block_size, self.kv_bytes = num_blocks or kv.num_blocks, kv.block_size, kv.nbytes
        self._requests: dict[int, RequestState] = {}
        self.penalties = PenaltyBook()  # the penalized requests' tokens (runner/penalties.py)
        # steps launched with their tokens on the way (runner/in_flight.py), and for the step being launched
        # the rows that take their input from the last of them: seq_id -> that step's row
        self.in_flight = StepsInFlight(self._append_token)
        self._chained: dict[int, int] = {}
        self._graph_sampled: set[int] = set()  # the step's rows its decode graph samples (runner/fast.py)
        self._held = []  # (runner/eager_sampling.py)
        self.vocab_size = int(text_config(model.config).vocab_size)
        self.proposer: Proposer | None = None  # speculative decoding's drafts (engine/speculative/proposers.py)
        # LoRA (engine/lora/adapters.py): the adapters' weights by the load a NewRequest names (None: this runner
        # serves none), and the stacked matrices of the adapter sets the steps use
        self.lora: LoraManager | None = None
        self.lora_stacks = StackCache(self.lora_groups(model))
        self.lora_kernels = True  # the compiled products where they apply (engine/lora/kernels.py)

    def lora_groups(self, model: PreTrainedModel) -> list[LoraGroup]:
        """The groups of linears this runner applies adapters to (engine/lora/adapters.py)."""
        return []

    def _lora(self, batch: StepBatch, part: list[int], tokens: list[int]) -> LoraBatch | None:
        """The adapters of rows `part`'s tokens (`tokens`: each row's count, in `part`'s order)."""
        if self.lora is None:
            return None
        adapters = [self._requests[batch.rows[i].seq_id].adapter for i in part]
        if all(a is None for a in adapters):
            return None
        per_token = [a for a, count in zip(adapters, tokens) for _ in range(count)]
        return LoraBatch.of(per_token, self.lora_stacks, self.kv.keys[0].device, self.lora_dtype, self.lora_kernels)

    @property
    def lora_dtype(self) -> torch.dtype:
        return self.kv.dtype  # the compute dtype (an fp8 pool stores another)

    def execute_batch(self, batch: StepBatch) -> StepOutput:
        """Apply the batch's difference to the persistent batch, run its rows as one forward, sample."""
        return self.collect(self.launch_batch(batch))

    def collect(self, launched: Launched) -> StepOutput:
        if launched.pending is not None:
            self.in_flight.receive(upto=launched.pending)
        return launched.output

    def _append_token(self, seq_id: int, token: int) -> None:
        state = self._requests.get(seq_id)
        if state is not None:  # (a request forgotten meanwhile: its token was computed in vain)
            state.output_ids.append(token)

    def _chain_from(self, batch: StepBatch) -> dict[int, int] | None:
        """For a batch that can run before the last step in flight is received: its rows whose input is
        that step's token, by seq_id, with their row there (None: receive every step first)."""
        return None

    def launch_batch(self, batch: StepBatch) -> Launched:
        """`execute_batch`, where a step of plain greedy rows may return with its tokens in flight."""
        with torch.inference_mode():
            chained = self._chain_from(batch)
            self.in_flight.receive(keep_last=chained is not None)
            if batch.rows:  # (a batch whose masks never came: its step failed; not a heartbeat's empty one)
                self._held = []
            self._chained = chained or {}
            for seq_id in batch.finished:
                self._forget(self._requests.pop(seq_id, None))
                if self.proposer is not None:
                    self.proposer.forget(seq_id)
            for seq_id in batch.preempted:
                self._requests[seq_id].blocks = []
            if batch.dropped_adapters and self.lora is not None:
                self.lora.drop(batch.dropped_adapters)
            out = StepOutput()
            for new in batch.new:
                self._forget(self._requests.get(new.seq_id))
                banned = banned_ids(new.params, self.eos_token_ids)
                state = self._requests[new.seq_id] = RequestState(
                    list(new.prompt_ids), new.params, new.seed, banned=banned
                )
                if new.adapter is not None:
                    self._adapter_of(new.seq_id, new.adapter, state, out)
                if new.images is not None:
                    self._images_of(new.seq_id, new.images, state, out)
            for n, row in enumerate(batch.rows):
                state = self._requests[row.seq_id]
                state.blocks.extend(row.new_blocks)
                if row.token_ids[0] == PENDING_TOKEN and row.seq_id not in self._chained:
                    # planned before its token was sampled: the last one (a chained row's is on the device)
                    batch.rows[n] = replace(row, token_ids=[(state.output_ids or state.prompt_ids)[-1]])
            rows = [i for i, row in enumerate(batch.rows) if row.seq_id not in out.errors]
            if rows:
                self._run_rows(batch, rows, out)
                if self.proposer is not None:
                    self._propose(batch, out)
            last = self.in_flight.last
            return Launched(out, last if last is not None and last.out is out else None)

    def _adapter_of(self, seq_id: int, ref: AdapterRef, state: RequestState, out: StepOutput) -> None:
        """The weights of a new request's adapter (`self.lora` reads them on the first request of a load);
        when they do not load, the request fails (its rows are not run), the step goes on."""
        if self.lora is None:
            out.errors[seq_id] = f"adapter `{ref.name}`: this model runner serves no LoRA adapters"
            return
        try:
            state.adapter = self.lora.get(ref)
        except Exception as exc:  # noqa: BLE001 - its files changed or went away: this request fails
            log.exception("adapter %s (load %d) cannot be read from %s", ref.name, ref.id, ref.path)
            out.errors[seq_id] = f"adapter `{ref.name}` cannot be loaded: {exc}"

    def _images_of(self, seq_id: int, images: ImageInputs, state: RequestState, out: StepOutput) -> None:
        """A new request's images: this runner serves none (a VLM's runner encodes them, runner/vision.py)."""
        out.errors[seq_id] = "this model runner serves no images"

    def _propose(self, batch: StepBatch, out: StepOutput) -> None:
        """The drafts the rows that asked for them get for the next step (none for a request whose
        last token ends it)."""
        assert self.proposer is not None
        self.in_flight.receive()  # the drafts follow the tokens just sampled
        wants: dict[int, tuple[list[int], int]] = {}
        for row in batch.rows:
            if not row.propose or row.seq_id not in out.samples:
                continue
            request = self._requests[row.seq_id]
            last, params = request.output_ids[-1], request.params
            if last in params.stop_token_ids or (last in self.eos_token_ids and not params.ignore_eos_token):
                continue
            wants[row.seq_id] = (request.prompt_ids + request.output_ids, row.propose)
        if not wants:
            return
        try:
            out.drafts = self.proposer.propose(wants)
        except Exception:  # noqa: BLE001 - no drafts this time; the requests go on
            log.exception("proposing drafts failed")

    def _run_rows(self, batch: StepBatch, part: list[int], out: StepOutput) -> None:
        """Rows `part` of the batch as one forward; if it raises, its decode rows together, then each
        chunk alone, so only the culprit fails."""
        try:
            logits = self._forward_rows(batch, part)
        except Exception as exc:  # noqa: BLE001 - find the culprit: each part alone, each failing alone
            decode = [i for i in part if i < batch.num_decode]
            parts = ([decode] if decode else []) + [[i] for i in part if i >= batch.num_decode]
            if len(parts) == 1:
                log.exception("model step failed for %d sequence(s)", len(part))
                for i in part:
                    out.errors[batch.rows[i].seq_id] = f"exception occurred during generation: {exc}"
                return
            log.exception("fused step of %d part(s) failed; re-running them one by one", len(parts))
            for rows in parts:
                self.in_flight.receive()  # (a part's pick in flight: the picks' two buffers hold two at most)
                self._run_rows(batch, rows, out)
            return
        self._finish_rows(batch, part, logits, out)

    def _kept(self, row: ScheduledTokens) -> int:
        """The logits rows a scheduled row keeps (its last positions): every position with prompt
        logprobs, else the last when it samples, else none; and every draft's when it samples."""
        kept = len(row.token_ids) if row.prompt_logprobs else int(row.sample)
        return kept + len(row.draft_token_ids) if row.sample else kept

    @abstractmethod
    def _forward_rows(self, batch: StepBatch, part: list[int]) -> torch.Tensor:
        """The kept logits rows of rows `part` of the batch (every decode row; per chunk `_kept`'s
        last positions), in `part`'s order."""

    def _send_pick(
        self, logits: torch.Tensor, sampled: bool = False, top_n: int = 0
    ) -> Callable[[], list[list[float]]] | None:
        """Where the forward computed the greedy pick of `logits` with them (`sampling.greedy_pick`: a decode
        step replayed from a CUDA graph, runner/fast.py) or, `sampled`, the rows' sampled pick (a graph that
        samples, runner/graph_sampling.py), start its transfer to the host, with `top_n` each row's likeliest
        tokens (`graph_sampling.with_top_n`), and return the call that waits for it; else None."""
        return None

    def _finish_rows(self, batch: StepBatch, part: list[int], logits: torch.Tensor, out: StepOutput) -> None:
        """Prompt logprobs, then every sampling row of `part` sampled together (the constrained ones
        from their rows masked by the batch's grammar bitmask)."""
        sampling: list[int] = []  # indexes into batch.rows
        at: list[int] = []  # their logits rows
        verifying: list[tuple[int, int]] = []  # rows with drafts: (index into batch.rows, first logits row)
        offset = 0
        for i in part:
            row = batch.rows[i]
            kept = self._kept(row)
            if row.prompt_logprobs:
                request = self._requests[row.seq_id]
                try:
                    out.prompt_logprobs[row.seq_id] = prompt_logprobs(
                        logits[offset : offset + kept],
                        request.prompt_ids,
                        row.start,
                        row.start + len(row.token_ids),
                        request.params.prompt_top_n,
                    )
                except Exception as exc:  # noqa: BLE001 - this request fails, the step goes on
                    log.exception("prompt logprobs failed")
                    out.errors[row.seq_id] = f"exception occurred during generation: {exc}"
            if row.sample and row.seq_id not in out.errors:
                if row.draft_token_ids:
                    verifying.append((i, offset + kept - len(row.draft_token_ids) - 1))
                else:
                    sampling.append(i)
                    at.append(offset + kept - 1)
            offset += kept
        for i, first in verifying:
            self._verify(batch.rows[i], logits[first : first + len(batch.rows[i].draft_token_ids) + 1], out)
        if not sampling:
            return
        rows = logits if at == list(range(len(logits))) else logits[at]
        grammar = set(batch.grammar_rows)
        if not grammar and all(self._requests[batch.rows[i].seq_id].plain for i in sampling):
            self._pick_greedy(logits, rows, [batch.rows[i].seq_id for i in sampling], out)
            return
        if rows is logits:  # (every row kept, in `sampling`'s order) a decode graph's pick may serve rows
            eager = self._graph_served(logits, batch, sampling, grammar, out)
            if len(eager) < len(sampling):  # the pick serves some rows (or all: none left here)
                if eager:
                    self._sample_eager(batch, [sampling[n] for n in eager], logits[eager], out)
                    # (the served rows' picks are received: a step of part of a graph's rows is never chained from)
                    self.in_flight.receive()
                return
        self._sample_eager(batch, sampling, rows, out)

    def _graph_served(
        self, logits: torch.Tensor, batch: StepBatch, sampling: list[int], grammar: set[int], out: StepOutput
    ) -> list[int]:
        """Where `logits` are a decode graph's step (`_send_pick`), the sampling rows its pick serves go in
        flight with it, with their top-N: those without a grammar whose token is their argmax (any graph's
        pick has it) or, where the graph sampled (runner/fast.py), `in_graph`. So one request's penalty or
        grammar sends its own row to the eager sampler, not the step's. The positions in `sampling` of the
        rows left to it (all of them where no graph ran)."""
        requests = [self._requests[batch.rows[i].seq_id] for i in sampling]
        every = list(range(len(sampling)))
        graphed = self._graph_sampled
        wanted = [  # (a top-N within reach)
            n
            for n in every
            if sampling[n] not in grammar
            and requests[n].in_graph
            and (requests[n].argmax or batch.rows[sampling[n]].seq_id in graphed)
        ]
        top = max((requests[n].params.top_n_tokens for n in wanted), default=0)
        try:
            sampled, receive = True, self._send_pick(logits, True, top) if wanted else None
            if receive is None and wanted:  # (not a sampled graph's: a greedy one's, or none)
                sampled, receive = False, self._send_pick(logits, False, top)
        except Exception:  # noqa: BLE001 - e.g. the top-N's memory: the eager sampler takes every row
            log.exception("sending a decode graph's pick failed; its rows are sampled from the logits")
            receive = None
        if receive is None:
            return every
        served = [n for n in wanted if sampled or requests[n].argmax]
        if not served:  # (a greedy graph's pick, and only sampled rows wanted)
            return every
        tops = [requests[n].params.top_n_tokens for n in served] if top else None
        if len(served) == len(sampling):
            self.in_flight.add(out, [batch.rows[i].seq_id for i in sampling], receive, tops)
            return []

        def served_picks() -> list[list[float]]:
            picks = receive()
            return [picks[n] for n in served]

        self.in_flight.add(out, [batch.rows[sampling[n]].seq_id for n in served], served_picks, tops)
        taken = set(served)
        return [n for n in every if n not in taken]

    def _pick_greedy(self, logits: torch.Tensor, rows: torch.Tensor, seq_ids: list[int], out: StepOutput) -> None:
        """The rows of a step whose sampling rows all sample plain greedily (`RequestState.plain`, no grammar):
        each its argmax and logprob (`greedy_pick`, as `sample_rows` picks them), with no `Row` made. Where the
        forward computed the pick with the logits (a decode graph's, `_send_pick`), its transfer starts and the
        tokens stay in flight (`collect`, or the next step, receives them); else they are received here, after
        the steps still in flight."""
        receive = self._send_pick(logits) if rows is logits else None
        self.in_flight.add(out, seq_ids, receive or (lambda: greedy_pick(rows).tolist()))
        if receive is None:
            self.in_flight.receive()
