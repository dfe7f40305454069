"""OpenAI's sampling parameters with OpenAI's meaning (vLLM's for its extensions): their ranges, checked
before anything else with a 400 naming the field, and their values as the engine's `SamplingParams` fields.

- ``temperature`` 0..2 (0: greedy; absent: 1), ``top_p`` in (0, 1], ``n`` >= 1.
- ``presence_penalty`` and ``frequency_penalty`` -2..2, additive on the logits of the tokens generated
  so far: ``logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)``.
- ``logit_bias``: token id (a string of digits) -> -100..100, added to that token's logit; an id
  outside the vocabulary is refused by the engine (400).
- vLLM's: ``repetition_penalty`` > 0 (multiplicative over prompt and output tokens), ``top_k`` (-1 or
  0: off), ``min_p`` 0..1, ``bad_words``, ``skip_special_tokens`` (default true); ``min_tokens``,
  ``ignore_eos`` and ``stop_token_ids`` are set with the stop fields (`parse`).

The request fields are `OpenAISampling` (lmiserve.protocols.openai.schema); ``seed`` with ``n`` > 1
gives choice i the seed ``seed + i`` (the engine's own stream per sequence, whatever the batch).
"""

from __future__ import annotations

import math
from typing import Any

from lmiserve.core.errors import InvalidRequest

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's: each bias within -100..100


def _number(value: float) -> str:
    return repr(value) if not math.isfinite(value) else f"{value:g}"


def _within(name: str, value: float | None, low: float, high: float, *, low_open: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value > high or (value <= low if low_open else value < low):
        opening = "(" if low_open else "["
        raise InvalidRequest(f"`{name}` must be in {opening}{_number(low)}, {_number(high)}], got {_number(value)}")


def check(req: Any) -> dict[int, float]:
    """OpenAI's and vLLM's ranges (InvalidRequest naming the field); `logit_bias` with integer keys."""
    _within("temperature", req.temperature, 0.0, 2.0)
    _within("top_p", req.top_p, 0.0, 1.0, low_open=True)
    _within("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _within("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    _within("min_p", req.min_p, 0.0, 1.0)
    if req.repetition_penalty is not None and not (
        math.isfinite(req.repetition_penalty) and req.repetition_penalty > 0
    ):
        raise InvalidRequest(f"`repetition_penalty` must be greater than zero, got {_number(req.repetition_penalty)}")
    if req.top_k is not None and req.top_k < -1:
        raise InvalidRequest(f"`top_k` must be -1 or 0 (disabled), or at least 1, got {req.top_k}")
    return logit_bias(req.logit_bias)


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (raw or {}).items():
        text = key.strip()
        if not text.isascii() or not text.isdigit():
            raise InvalidRequest(f"`logit_bias` keys must be token ids (non-negative integers), got {key[:40]!r}")
        if not (math.isfinite(value) and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
            raise InvalidRequest(
                f"`logit_bias` values must be in [-100, 100], got {_number(value)} for token {int(text)}"
            )
        bias[int(text)] = value
    return bias


def fields(req: Any, bias: dict[int, float]) -> dict[str, Any]:
    """The request's sampling fields as the engine's `SamplingParams` fields (after `check`)."""
    return {
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        "top_k": max(req.top_k or 0, 0),
        "min_p": req.min_p or 0.0,
        "logit_bias": bias,
        "bad_words": list(req.bad_words or ()),
        "skip_special_tokens": req.skip_special_tokens,
    }
