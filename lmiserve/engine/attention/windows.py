"""Sliding-window attention: which layers of a model attend over a window, and the masks that say so.

transformers' meaning (``masking_utils.sliding_window_overlay``, ANDed with the causal mask): in a layer
with window ``W`` the token at position ``q`` sees the keys at positions ``k`` with ``q - W < k <= q``,
its own and the ``W - 1`` before it. Which layers have one (`layer_windows`):

- a config with ``layer_types`` (Qwen2 with ``use_sliding_window``: the layers from ``max_window_layers``
  on; Gemma 2/3: sliding layers between full ones): its ``sliding_attention`` layers, with
  ``config.sliding_window``; ``full_attention`` layers see the whole context;
- otherwise every layer, when ``config.sliding_window`` is set (Mistral, Mixtral, Phi-3, Starcoder2),
  unless ``use_sliding_window`` is False.

Every attention over the paged KV cache takes the window of its layer: the compiled CPU kernel and the
torch decode path (engine/attention/paged.py), the prefill chunks' SDPA masks (engine/model/fast_llama.py), the
Triton kernel (engine/attention/triton_ops.py) and transformers' own attention on the generic runner, whose
per-layer-kind masks `step_mask` builds (engine/runner/generic.py). Blocks wholly before every
layer's window stay allocated (masked, not freed); the batch-invariant runner runs transformers' forward,
which applies the windows itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "FULL",
    "SLIDING",
    "chunk_masks",
    "hidden_outside",
    "layer_windows",
    "model_window",
    "step_mask",
    "unsupported_kinds",
    "visible",
]

FULL, SLIDING = "full_attention", "sliding_attention"
# architectures whose forward ignores `layer_types` (one mask for every layer, from `sliding_window`)
_ONE_MASK_TYPES = ("mistral", "mixtral", "ministral3")


def text_config(config: Any) -> Any:
    """The decoder's config: a vision-language model's text config, else `config` itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _layer_types(config: Any) -> list[str] | None:
    config = text_config(config)
    kinds = getattr(config, "layer_types", None)
    if not kinds or getattr(config, "model_type", None) in _ONE_MASK_TYPES:
        return None
    return list(kinds)


def _window(config: Any) -> int | None:
    config = text_config(config)
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each decoder layer's window (None: the whole context), as transformers applies it."""
    layers = int(text_config(config).num_hidden_layers)
    window = _window(config)
    kinds = _layer_types(config)
    if kinds is None:
        return (window,) * layers
    return tuple(window if kind == SLIDING else None for kind in kinds[:layers])


def model_window(config: Any) -> int | None:
    """The window of the model's windowed layers (one size for all of them), None when none has one."""
    return next((w for w in layer_windows(config) if w is not None), None)


def unsupported_kinds(config: Any) -> str | None:
    """Why the paged attention cannot mask `config`'s layers as transformers does (None: it can): layer
    kinds other than full and sliding attention (chunked, linear, ...), or a bidirectional window."""
    kinds = _layer_types(config)
    if kinds is not None and set(kinds) - {FULL, SLIDING}:
        return f"attention layers of kinds {sorted(set(kinds))}"
    if getattr(text_config(config), "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None


def visible(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[queries, keys]`` True where the query at its position sees the key at its position: causal, and
    within `window` positions (its own included) when there is one."""
    seen = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        seen &= key_positions[None, :] > query_positions[:, None] - window
    return seen


def chunk_masks(
    positions: torch.Tensor, end: int, windows: Sequence[int | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A prefill chunk's boolean SDPA masks (``[1, 1, tokens, end]``) over its sequence's keys ``0..end-1``,
    its tokens at `positions`: the causal one, and with the window of the model's windowed layers (None when
    none of `windows` has one)."""
    keys = torch.arange(end, device=positions.device)
    window = next((w for w in windows if w is not None), None)
    windowed = None if window is None else visible(positions, keys, window)[None, None]
    return visible(positions, keys, None)[None, None], windowed


def step_mask(
    config: Any,
    spans: Sequence[tuple[int, int, int, int]],
    tokens: int,
    keys: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive mask(s) of one forward of packed rows (engine/runner/generic.py): ``[1, 1,
    tokens, keys]``, 0 where token t of a row sees a key of the same row, -inf elsewhere. `spans`: each row's
    (first token, tokens, start position, first key). For a model with windowed layers the window is in:
    one mask when every layer has it and the model takes one (Mistral), else one a layer kind, as the
    model's own forward takes them when given (``{"full_attention": ..., "sliding_attention": ...}``)."""
    window = model_window(config)

    def one(limit: int | None) -> torch.Tensor:
        mask = torch.full((tokens, keys), float("-inf"), dtype=dtype, device=device)
        for first, count, start, offset in spans:
            seen = visible(
                torch.arange(start, start + count, device=device), torch.arange(start + count, device=device), limit
            )
            mask[first : first + count, offset : offset + start + count].masked_fill_(seen, 0.0)
        return mask[None, None]

    if window is None:
        return one(None)
    if _layer_types(config) is None:
        return one(window)
    return {FULL: one(None), SLIDING: one(window)}


def hidden_outside(spans: torch.Tensor, hidden: torch.Tensor, window: int | None) -> torch.Tensor:
    """A decode step's mask of hidden keys (``hidden``: ``[rows, 1, 1, keys]``, True past each row's span)
    with, for a `window`, the keys before it hidden too (`spans`: ``[rows]``, a row's position + 1)."""
    if window is None:
        return hidden
    positions = torch.arange(hidden.shape[-1], device=hidden.device)
    return hidden | (positions[None, :] < (spans[:, None] - window))[:, None, None, :]
