"""Fakes for engine unit tests: tokenizers without files and a model runner without torch.

- `FakeTokenizer`: every token id has a fixed text; ``decode`` joins them (special ids skipped on request).
- `ByteTokenizer`: every token id is a byte string; ``decode`` joins the bytes and decodes UTF-8 with
  replacement, like a byte-level BPE tokenizer whose tokens can end in the middle of a character.
- `make_seq`: a `Sequence` with sensible defaults.
- `FakeRunner`: executes a `StepPlan` on a simulated slot array (one list of token ids per slot),
  checking that every running sequence finds its own KV prefix in its slot, and samples scripted
  tokens. `drive` runs schedule/execute/update steps and collects the events.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

from lmiserve.core.events import StepEvent
from lmiserve.core.request import SamplingParams
from lmiserve.engine.scheduler import Scheduler, StepPlan
from lmiserve.engine.sequence import SeqStatus, Sequence
from lmiserve.engine.step import SampleResult, StepOutput

EOS = 2
BOS = 1
SPECIAL = {BOS: "<s>", EOS: "</s>"}


class FakeTokenizer:
    """id -> fixed text; ids without an explicit text decode as ``"w{id} "``."""

    def __init__(self, texts: dict[int, str] | None = None, special: dict[int, str] | None = None):
        self.texts = dict(texts or {})
        self.special = dict(SPECIAL if special is None else special)
        self.calls = 0

    def text(self, token_id: int) -> str:
        if token_id in self.special:
            return self.special[token_id]
        return self.texts.get(token_id, f"w{token_id} ")

    def decode(self, ids: Seq[int], skip_special_tokens: bool = False) -> str:
        self.calls += 1
        return "".join(self.text(i) for i in ids if not (skip_special_tokens and i in self.special))

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.special)


class ByteTokenizer:
    """id -> bytes; decode joins the bytes and decodes UTF-8 with U+FFFD for incomplete characters."""

    def __init__(self, pieces: dict[int, bytes], special: dict[int, str] | None = None):
        self.pieces = pieces
        self.special = dict(SPECIAL if special is None else special)

    def decode(self, ids: Seq[int], skip_special_tokens: bool = False) -> str:
        data = b"".join(
            self.special[i].encode() if i in self.special else self.pieces[i]
            for i in ids
            if not (skip_special_tokens and i in self.special)
        )
        return data.decode("utf-8", errors="replace")

    @classmethod
    def for_text(cls, text: str, split: Callable[[bytes], list[bytes]]) -> tuple[ByteTokenizer, list[int]]:
        """A tokenizer whose vocabulary is the pieces `split` cuts `text` into, and the ids of `text`."""
        pieces: dict[int, bytes] = {}
        ids = []
        for piece in split(text.encode()):
            token_id = next((k for k, v in pieces.items() if v == piece), None)
            if token_id is None:
                token_id = 10 + len(pieces)
                pieces[token_id] = piece
            ids.append(token_id)
        return cls(pieces), ids


_seq_ids = itertools.count(1)


def make_seq(
    prompt_ids: list[int] | None = None,
    params: SamplingParams | None = None,
    *,
    tokenizer=None,
    eos: Iterable[int] = (EOS,),
    arrival: float = 0.0,
    seq_id: int | None = None,
    request_id: str | None = None,
    index: int = 0,
    **param_overrides,
) -> Sequence:
    if params is None:
        params = SamplingParams(**param_overrides)
    elif param_overrides:
        raise TypeError("give params or overrides, not both")
    tokenizer = tokenizer or FakeTokenizer()
    sid = next(_seq_ids) if seq_id is None else seq_id
    prompt_ids = [BOS, 10, 11] if prompt_ids is None else prompt_ids
    return Sequence(
        sid,
        request_id or f"req-{sid}",
        tokenizer.decode(prompt_ids),
        prompt_ids,
        params,
        tokenizer=tokenizer,
        eos_token_ids=set(eos),
        special_token_ids=set(getattr(tokenizer, "special", {})),
        seed=None,
        index=index,
        arrival=arrival,
    )


def feed(seq: Sequence, ids: Iterable[int], logprob: float = -0.5) -> list[StepEvent]:
    """Call on_token for each id until the sequence finishes; return the events."""
    events = []
    for token_id in ids:
        events.append(seq.on_token(token_id, logprob))
        if events[-1].finish is not None:
            break
    return events


def check_running_layout(scheduler: Scheduler) -> None:
    """RUNNING sequences occupy slots 0..R-1, PREFILL ones follow; slot == index; all within limits."""
    statuses = [s.status for s in scheduler.running]
    decoding = statuses.count(SeqStatus.RUNNING)
    assert statuses == [SeqStatus.RUNNING] * decoding + [SeqStatus.PREFILL] * (len(statuses) - decoding), statuses
    for index, seq in enumerate(scheduler.running):
        assert seq.slot == index, (seq.seq_id, seq.slot, index)
    assert len(scheduler.running) <= scheduler.max_running
    for seq in scheduler.waiting:
        assert seq.status is SeqStatus.WAITING and seq.slot is None
    running_ids = {s.seq_id for s in scheduler.running}
    assert not running_ids & {s.seq_id for s in scheduler.waiting}


# A sampling rule: (seq, step_number) -> token id; the default never picks EOS.
TokenRule = Callable[[Sequence, int], int]


def default_rule(seq: Sequence, step: int) -> int:
    return 100 + (seq.seq_id * 7 + len(seq.output_ids) * 3) % 50


class FakeRunner:
    """Executes plans on a simulated KV cache: `kv[slot]` is the list of token ids stored in that slot.

    Before writing, it checks that each sequence of the plan (and every running sequence) finds its
    own tokens ``all_ids[:kv_len]`` in its slot after the plan's moves are replayed; that decode rows
    are slots 0..n-1; that prefill chunks continue where the sequence's KV ends.
    """

    def __init__(self, scheduler: Scheduler, rule: TokenRule = default_rule, num_slots: int | None = None):
        self.scheduler = scheduler
        self.rule = rule
        self.kv: list[list[int | None]] = [[] for _ in range(num_slots or scheduler.max_running)]
        self.step = 0
        self.errors: dict[int, str] = {}  # seq_id -> error to report at the next step
        self.fail_decode: str | None = None  # the whole decode forward fails at the next step
        self.log: list[StepPlan] = []
        self.pool: dict[int, list[int | None]] = {}  # the prefix cache's blocks: pool index -> token ids

    def prepare_slots(self, plan: StepPlan) -> None:
        """The plan's prefix cache saves and slot moves in their order, then its loads (as
        `ModelRunner._prepare_slots`); a saved block must be complete, a loaded one filled by a save."""
        size = self.scheduler.prefix.block_size if self.scheduler.prefix is not None else 0
        saves = sorted(plan.saves, key=lambda save: save.before_move)
        for number, move in enumerate([*plan.moves, None]):
            while saves and saves[0].before_move <= number:
                save = saves.pop(0)
                for block, index in save.blocks:
                    stored = list(self.kv[save.slot][block * size : (block + 1) * size])
                    assert len(stored) == size and None not in stored, (save, stored)
                    self.pool[index] = stored
            if move is not None:
                src, dst, length = move
                assert length >= 0
                self.kv[dst][:length] = list(self.kv[src][:length])
        for load in plan.loads:
            tokens = [t for index in load.match.blocks for t in self.pool[index]][: load.match.tokens]
            assert len(tokens) == load.match.tokens
            self.kv[load.slot][: len(tokens)] = tokens

    def _write(self, slot: int, pos: int, token_id: int) -> None:
        row = self.kv[slot]
        if len(row) <= pos:
            row.extend([None] * (pos + 1 - len(row)))
        row[pos] = token_id

    def check_contents(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            expected = seq.all_ids[: seq.kv_len]
            assert seq.slot is not None
            actual = self.kv[seq.slot][: seq.kv_len]
            assert actual == expected, f"slot {seq.slot} of seq {seq.seq_id}: {actual} != {expected}"

    def execute(self, plan: StepPlan) -> StepOutput:
        self.step += 1
        self.log.append(plan)
        self.prepare_slots(plan)
        self.check_contents(self.scheduler.running)
        out = StepOutput()
        for row, seq in enumerate(plan.decode):
            assert seq.slot == row, (seq.seq_id, seq.slot, row)
            assert seq.status is SeqStatus.RUNNING
            assert seq.kv_len == seq.prompt_len + len(seq.output_ids) - 1
        for chunk in plan.prefill:
            seq = chunk.seq
            assert seq.status is SeqStatus.PREFILL
            assert chunk.start == seq.kv_len and chunk.length > 0
            assert chunk.start + chunk.length <= seq.prompt_len
        if plan.decode:
            if self.fail_decode is not None:
                for seq in plan.decode:
                    out.errors[seq.seq_id] = self.fail_decode
                self.fail_decode = None
            else:
                for seq in plan.decode:
                    self._write(seq.slot, seq.kv_len, seq.output_ids[-1])
                    self._sample(seq, out)
        for chunk in plan.prefill:
            seq = chunk.seq
            for pos in range(chunk.start, chunk.start + chunk.length):
                self._write(seq.slot, pos, seq.prompt_ids[pos])
            if chunk.completes_prompt:
                self._sample(seq, out)
        return out

    def _sample(self, seq: Sequence, out: StepOutput) -> None:
        if seq.seq_id in self.errors:
            out.errors[seq.seq_id] = self.errors.pop(seq.seq_id)
            return
        token = self.rule(seq, self.step)
        out.samples[seq.seq_id] = [SampleResult(token, -0.25)]


def run_step(
    scheduler: Scheduler, runner: FakeRunner, now: float = 0.0
) -> tuple[StepPlan, list[tuple[Sequence, StepEvent]]]:
    """One engine step: schedule, execute (if there is model work), update. Checks the layout."""
    plan, events = scheduler.schedule(now)
    check_running_layout(scheduler)
    if plan.has_model_work:
        output = runner.execute(plan)
        events = events + scheduler.update(plan, output)
    else:
        runner.prepare_slots(plan)
    check_running_layout(scheduler)
    return plan, events


def drive(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000, now: float = 0.0):
    """Step until the scheduler has no work; return all events in order."""
    events: list[tuple[Sequence, StepEvent]] = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            return events
        _, new = run_step(scheduler, runner, now)
        events.extend(new)
    raise AssertionError("scheduler did not drain")
