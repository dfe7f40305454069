"""The tokenizer operations the engine uses, whatever implements them.

A transformers tokenizer is adapted to this protocol by `lmiserve.engine.text.tokenizer.HfTokenizer`;
tests use small fakes.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import ParamSpec, Protocol, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

# The prompts a request's own task tokenized (tokenizer, text -> ids): a protocol that counts a
# prompt's tokens to validate it leaves them here, and the engine's encoding of the same text in the
# same request reuses them, so a prompt is tokenized once. A context variable holding a box: each
# request's task sees only its own box, and the tokenizer thread (`tokenizing`) fills the box of the
# task that handed it the work (a context is copied into a thread; the box in it is the same object).
# (The box holds the tokenizer itself beside the ids, so its id is not reused while the entry lives.)
# A vision-language model's prompt with images is kept the same way (`remember`, `recall`): its
# processor's output, counted by the protocol through the engine's codec, is the engine's encoding.
_Box = dict[tuple[int, Hashable], tuple[object, object]]
_encodings: ContextVar[_Box | None] = ContextVar("lmiserve_encodings", default=None)
_BOX_LIMIT = 64  # a request with more prompts than this re-tokenizes the oldest

# One thread tokenizes for every model (templates, counting, encoding, a text model's batches): off
# the event loop, and never two calls into one transformers tokenizer at once (its Rust backend
# refuses a truncation change while another call holds it: "Already borrowed").
_TOKENIZER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmiserve-tokenize")


def _box() -> _Box:
    """This request's box; made in the current task when it has none. Outside a task (the tokenizer
    thread handed no box, a plain call) a box of no one's, so nothing outlives the call: a box set in a
    long-lived context would be inherited by every task made from it."""
    box = _encodings.get()
    if box is None:
        box = {}
        if _in_task():
            _encodings.set(box)
    return box


def _in_task() -> bool:
    try:
        return asyncio.current_task() is not None
    except RuntimeError:  # no running event loop in this thread
        return False


def remember_encoding(tokenizer: object, text: str, ids: list[int]) -> None:
    """Record the ids `tokenizer` (the transformers tokenizer object) gave `text`, for this request."""
    remember(tokenizer, text, tuple(ids))


def recall_encoding(tokenizer: object, text: str) -> list[int] | None:
    """The ids this request recorded for exactly `text` with the same `tokenizer`, else None."""
    ids = recall(tokenizer, text)
    return list(ids) if isinstance(ids, tuple) else None


def remember(owner: object, key: Hashable, value: object) -> None:
    """Record `value`, what `owner` (a tokenizer, a processor) made of `key`, for this request."""
    box = _box()
    if len(box) >= _BOX_LIMIT:
        del box[next(iter(box))]
    box[(id(owner), key)] = (owner, value)


def recall(owner: object, key: Hashable) -> object | None:
    """What this request recorded for exactly `key` with the same `owner`, else None."""
    box = _encodings.get()
    entry = box.get((id(owner), key)) if box is not None else None
    return entry[1] if entry is not None and entry[0] is owner else None


async def tokenizing(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """`await tokenizing(fn, ...)`: `fn(...)`, work that tokenizes (a chat template, counting a prompt,
    encoding a request), on the tokenizer thread in this task's context: what it remembers, this
    request recalls; its exceptions are raised here."""
    _box()  # in this task, before the context is copied, so the thread fills this task's box
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, lambda: context.run(fn, *args, **kwargs))


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]:
        """The prompt's token ids, with the special tokens the model expects (e.g. BOS)."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str:
        """The text of these ids (incomplete UTF-8 at the end decodes as U+FFFD)."""
        ...

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special tokens (BOS, EOS, padding, ...)."""
        ...

    def __len__(self) -> int:
        """Vocabulary size including added tokens."""
        ...
