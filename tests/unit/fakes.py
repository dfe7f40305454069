"""Fakes for engine unit tests: tokenizers without files and a model runner without torch.

- `FakeTokenizer`: every token id has a fixed text; ``decode`` joins them (special ids skipped on request).
- `ByteTokenizer`: every token id is a byte string; ``decode`` joins the bytes and decodes UTF-8 with
  replacement, like a byte-level BPE tokenizer whose tokens can end in the middle of a character.
- `make_seq`: a `Sequence` with sensible defaults.

The block scheduler's fake runner and step helpers are in block_harness.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

from lmiserve.core.events import StepEvent
from lmiserve.core.request import SamplingParams
from lmiserve.engine.core.sequence import Sequence

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
