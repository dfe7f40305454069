"""The step contract between the engine core and the model: plain data, so it can cross a process boundary.

The engine core (the block scheduler, the grammar matchers, the detokenizer: everything that holds a
`Sequence`) plans a step as a `StepBatch`: which requests are new (their prompt, sampling parameters and
seed, sent once), which tokens of which requests to compute at which positions, the blocks each
request's table gained since the last step, which requests left (or were preempted), and the grammar
bitmask of the constrained rows that sample. Nothing in it holds a tokenizer, a matcher or a tensor: a
request's LoRA adapter is named by its name, load id and folder (`AdapterRef`), and the runner's side
reads its weights itself (engine/lora/manager.py; in every tensor-parallel rank, its shard of them).

An `Executor` runs a batch on the model and answers with a `StepOutput` (below):
the tokens sampled for each request (a list: a step samples several tokens of a request whose row
carries drafts to verify, `ScheduledTokens.draft_token_ids`), prompt logprobs, and per-request errors.
The executor keeps a persistent batch: what it was told about each request (tokens, parameters,
generator, block table) stays until the request is finished, and every step only updates it by
difference. `InProcessExecutor` runs the model in this process (the engine's torch thread); a
tensor-parallel executor sends the same batches to its workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from lmiserve.core.request import SamplingParams
from lmiserve.engine.text.images import ImageInputs


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter as the step contract names it: one load of adapter `name` (`id`, new at every load
    of the engine's registry, engine/lora/registry.py) from PEFT's folder `path`. The runner's side reads
    the weights from `path` itself (`lora.manager.LoraManager`) and keeps them under `id` until a batch's
    `dropped_adapters` names it."""

    name: str
    id: int
    path: str


@dataclass(frozen=True)
class NewRequest:
    """A request the executor has not seen: sent once, kept until the request is finished."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams  # plain data (its grammar is a spec; the matcher stays in the engine core)
    seed: int | None  # a sampled request's generator is seeded from it (batch-independent streams)
    adapter: AdapterRef | None = None  # its LoRA adapter (None: the base model)
    # a vision-language model's prompt: its images' processor tensors (numpy) and token spans (None: text)
    images: ImageInputs | None = None


# a decode row's token when it was planned before the step that samples it had run (overlap scheduling):
# the executor takes the request's last sampled token from its persistent batch
PENDING_TOKEN = -1


@dataclass(frozen=True)
class ScheduledTokens:
    """Tokens of one request to compute in this step, from position `start`."""

    seq_id: int
    start: int
    token_ids: list[int]
    new_blocks: list[int]  # appended to the request's block table (after a preemption: its whole table)
    sample: bool  # the tokens reach the request's end: sample its next token
    prompt_logprobs: bool = False  # record the logprobs of these (prompt) positions
    # proposed tokens (speculative decoding), computed after `token_ids` and verified by the step: it
    # samples at the last of `token_ids` and at each draft in turn and keeps each draft its sample
    # equals, so the request gets the accepted drafts plus one token (the first sample that differs, or
    # one after the last draft): as many samples as tokens, each from the target's own distribution
    draft_token_ids: list[int] = field(default_factory=list)
    # drafts to propose for the request after this step's sampling (speculative decoding; 0: none),
    # answered in `StepOutput.drafts` for the next step to verify
    propose: int = 0

    @property
    def computed_ids(self) -> list[int]:
        """The tokens the forward computes: `token_ids`, then the drafts."""
        return self.token_ids + self.draft_token_ids if self.draft_token_ids else self.token_ids


@dataclass
class StepBatch:
    """One step of the model, as plain data. `rows[:num_decode]` decode (one token each, their last
    sampled token); the rest are chunks of prompts (or, after a preemption, of prompt and output) and
    decoding rows with drafts (their last sampled token and the drafts, computed as a chunk)."""

    rows: list[ScheduledTokens] = field(default_factory=list)
    num_decode: int = 0
    new: list[NewRequest] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # forget these requests (before this step)
    preempted: list[int] = field(default_factory=list)  # their blocks were taken back (before this step)
    # adapter loads (`AdapterRef.id`) the engine's registry let go: no request uses them and none will;
    # the runner's side forgets their weights (before this step)
    dropped_adapters: list[int] = field(default_factory=list)
    # the constrained sampling rows (indexes into `rows`) and their int32 bitmask (bit t = token t allowed)
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # planned while the step before it ran (overlap scheduling): `grammar_rows` are the rows that may be
    # masked, whose mask follows the tokens of that step; the runner holds their logits until the engine
    # sends the masks (`Executor.sample_masked`), and samples the other rows at once
    mask_later: bool = False

    @property
    def has_model_work(self) -> bool:
        return bool(self.rows)


@dataclass
class SampleResult:
    """A token sampled for a request, its logprob and, with `top_n_tokens`, the top (id, logprob) pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None


class PromptScores(NamedTuple):
    """The logprobs of a chunk's prompt tokens: from position `start`, each token's logprob (the prompt's
    first token has none); with `prompt_top_n`, each token's rank and the top-N (id, logprob) there."""

    start: int
    logprobs: list[float | None]
    ranks: list[int | None] | None = None
    tops: list[list[tuple[int, float]] | None] | None = None


@dataclass
class StepOutput:
    """What the executor computed for a batch (a plan), keyed by seq_id."""

    # the tokens sampled for each sequence, in order (one, or several where a step verifies several)
    samples: dict[int, list[SampleResult]] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptScores] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    # speculative decoding: drafts proposed for the next step (the rows that asked, `ScheduledTokens.propose`)
    drafts: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class Launched:
    """A batch handed to the model (`Executor.launch`): its output, complete unless `pending` (its sampled
    tokens are still on their way from the device; `Executor.collect` waits for them)."""

    output: StepOutput
    pending: Any = None  # the runner's handle of the transfer in flight (None: the output is complete)


class ExecutorFailed(RuntimeError):
    """The executor can run no more steps (a worker process died, or a step ran past `step_timeout`): not
    one step's failure but the engine's (`AsyncEngine._die`)."""


class Executor(ABC):
    """Runs step batches on one model (its KV pool of `num_blocks` blocks of `block_size` tokens, of
    `kv_bytes` in all)."""

    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int]
    kv_bytes: int = 0

    @abstractmethod
    def execute(self, batch: StepBatch) -> StepOutput:
        """Apply the batch's bookkeeping, compute its rows, sample; never raise for one request's failure
        (`ExecutorFailed` when the executor itself can go on no more)."""

    def launch(self, batch: StepBatch) -> Launched:
        """`execute`, except that the step's sampled tokens may still be on their way from the device when
        it returns (overlap scheduling: the next batch can be launched before they arrive, and may take
        them as its rows' inputs on the device); by default the whole step."""
        return Launched(self.execute(batch))

    def collect(self, launched: Launched) -> StepOutput:
        """The complete output of a launched batch (waiting for its tokens; the batches launched before
        it are complete too)."""
        return launched.output

    @property
    def defers_masks(self) -> bool:
        """Whether a batch may be launched before its grammar masks are known (`StepBatch.mask_later`),
        its constrained rows sampled when they come (`sample_masked`); else a step whose tokens may be
        masked is planned after the step before it."""
        return False

    def sample_masked(self, rows: list[int], bitmask: np.ndarray | None) -> StepOutput:
        """The rows the last `mask_later` batch held back, sampled: `rows` (indexes into its rows, those still
        constrained) masked by `bitmask` (a row each, in `rows`' order), the others unmasked. Their samples
        and errors, which complete that batch's output."""
        raise NotImplementedError("this executor samples every row when it launches a batch")

    def watch(self, on_failure: Callable[[str], None]) -> None:  # noqa: B027 - most executors have nothing to watch
        """Call `on_failure` (from any thread) if the executor fails between steps (a worker dies)."""

    def close(self) -> None:  # noqa: B027 - most executors hold nothing to release
        """Release what the executor holds (its worker processes)."""


class BatchRunner(ABC):
    """A model runner that executes `StepBatch`es itself (runner/fast.py)."""

    num_blocks: int
    block_size: int
    vocab_size: int  # the width of its logits (the grammar bitmask's tokens)
    eos_token_ids: list[int]

    @abstractmethod
    def execute_batch(self, batch: StepBatch) -> StepOutput: ...

    def launch_batch(self, batch: StepBatch) -> Launched:
        """`Executor.launch` in this process (by default the whole step)."""
        return Launched(self.execute_batch(batch))

    def collect(self, launched: Launched) -> StepOutput:
        """`Executor.collect` in this process."""
        return launched.output

    defers_masks = False  # `Executor.defers_masks` in this process

    def sample_masked(self, rows: list[int], bitmask: np.ndarray | None) -> StepOutput:
        """`Executor.sample_masked` in this process."""
        raise NotImplementedError("this runner samples every row when it launches a batch")
