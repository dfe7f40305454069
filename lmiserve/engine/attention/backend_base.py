"""The interface of an attention backend (engine/attention/backends.py has the backends and `choose`): the step's
sequences as a backend plans them (`SeqTokens`), and what every backend does with them (`AttentionBackend`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from lmiserve.engine.attention.paged import PagedKVCache


@dataclass(frozen=True)
class SeqTokens:
    """One sequence's tokens of a step, in the step's token order: `count` tokens at positions
    ``start..start+count-1``, read and written through `table` (its block table); `opens`: spans of those
    positions ``(first, end)`` whose tokens see each other both ways (Gemma 3's images: the torch backend's
    chunks take them, FastLlama runs such a step on it)."""

    table: Sequence[int]
    start: int
    count: int
    opens: tuple[tuple[int, int], ...] = ()


class KvStore(NamedTuple):
    """Where a layer's keys and values of a step go (`AttentionBackend.store_target`), for a kernel that makes them
    to store them itself: the layer's key and value caches as rows of ``head_dim`` (``[rows, head_dim]``), each
    (token, kv head)'s row in them (`rows`, ``[written * kv_heads]``, token-major), the layer's (key, value)
    scales (an fp8 cache's: attention/kv_quant.py) and how many of the step's first tokens are stored (`written`;
    padding rows after them are not)."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: torch.Tensor
    scales: tuple[float, float]
    written: int


class AttentionBackend(ABC):
    """One attention implementation over a `PagedKVCache`, for a model's attention shape."""

    name: ClassVar[str]

    def __init__(self, cache: PagedKVCache, heads: int, layer_windows: Sequence[int | None]) -> None:
        """`layer_windows`: each layer's sliding window (None: the whole context; attention/windows.py)."""
        self.cache = cache
        self.heads, self.kv_heads, self.head_dim = heads, cache.kv_heads, cache.head_dim
        self.groups = heads // cache.kv_heads
        self.scale = self.head_dim**-0.5
        self.softcap: float | None = None  # the scores' soft cap (Gemma 2's `attn_logit_softcapping`)
        # each layer's sink logits (``[heads]``, float32; gpt-oss's), in every softmax with no value; None: none
        self.sinks: Sequence[torch.Tensor] | None = None
        self.windows = tuple(layer_windows)

    def sink(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s sink logits (None: the model has none)."""
        return None if self.sinks is None else self.sinks[layer]

    @abstractmethod
    def plan(self, seqs: Sequence[SeqTokens], decode_rows: int, pad: int) -> Any:
        """The step's metadata, shared by every layer: `seqs` in the step's token order (the first
        `decode_rows` of them one token each), then `pad` padding tokens (they attend nothing; their
        output rows are zero or ignored)."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, scale: float | None = None
    ) -> torch.Tensor:
        """Layer `layer`'s attention of the step's tokens: `q` ``[T, heads, head_dim]``, `k`/`v` ``[T,
        kv_heads, head_dim]`` (stored in the cache first); ``[T, heads * head_dim]``. `scale`: of the
        scores (default ``head_dim ** -0.5``)."""

    def store_target(self, layer: int, meta: Any) -> KvStore | None:
        """Where layer `layer`'s keys and values of the step planned as `meta` are stored, for a kernel that makes
        them to store them itself and then call `attend_stored` (None, the default: `forward` stores them)."""
        return None

    def attend_stored(
        self,
        layer: int,
        q: torch.Tensor,
        meta: Any,
        scale: float | None = None,
        fp8_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`forward` of a step whose keys and values are already stored where `store_target` said. `fp8_rows`
        (where `writes_fp8_rows`): room for the output's rows in fp8 over each row's range, which the attention's
        kernel also writes (their bytes, ``[rows padded to 16, heads * head_dim]`` uint8, the padding rows zero; their
        fp32 scales, ``[rows padded]``), for the product that reads the output (`fp8_w8a8.given_rows`)."""
        raise NotImplementedError(f"{self.name} stores its own keys and values (store_target is None)")

    def writes_fp8_rows(self, meta: Any) -> bool:
        """Whether `attend_stored` can write the output's rows of the step planned as `meta` in fp8 too."""
        return False

    def _ensure(self, seqs: Sequence[SeqTokens]) -> None:
        """Every block the step touches is zeroed (`PagedKVCache.ensure_zeroed`) before it is read."""
        top = max((max(s.table) for s in seqs if s.table), default=-1)
        self.cache.ensure_zeroed(1 + top)
