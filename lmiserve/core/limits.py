"""The text routes' request limits (TGI's router limits, OpenAI's max_logprobs and prompts per
completions request), resolved against the served model (TGI's and OpenAI's routes apply them; the
metrics size TGI's token histograms by them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TextGenLimits:
    """Server limits as TGI's router applies them (max_input_tokens < max_total_tokens)."""

    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int = 1023
    max_total_tokens: int = 1024
    max_client_batch_size: int = 4  # TGI's (its /info); OpenAI's completions take `max_prompts`
    max_logprobs: int = 20  # OpenAI's logprobs / top_logprobs and vLLM's prompt_logprobs (not TGI's)
    max_prompts: int = 32  # prompts in one OpenAI completions request: the engine's max_num_seqs


def limits_for(service: Any) -> TextGenLimits:
    """The settings' values bounded by the model: max_total_tokens <= context length, max_input_tokens
    < max_total_tokens and <= max_input_len when that LMI option is set. `service` is a ModelService
    (anything with `settings` and `loaded.max_context`)."""
    s = service.settings
    context = service.loaded.max_context
    total = min(s.max_total_tokens or context, context)
    max_input = s.max_input_tokens or s.max_input_len or total - 1
    if s.max_input_len:
        max_input = min(max_input, s.max_input_len)
    return TextGenLimits(
        max_concurrent_requests=s.max_concurrent_requests,
        max_best_of=s.max_best_of,
        max_stop_sequences=s.max_stop_sequences,
        max_top_n_tokens=s.max_top_n_tokens,
        max_input_tokens=min(max_input, total - 1),
        max_total_tokens=total,
        max_client_batch_size=s.max_client_batch_size,
        max_logprobs=s.max_logprobs,
        max_prompts=s.max_rolling_batch_size,
    )
