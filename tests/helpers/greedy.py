"""Greedy reference continuations from the model's own `generate`, for engine parity tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def greedy_reference(loaded) -> Callable[[list[int], int], list[int]]:
    """`generate(prompt_ids, max_new_tokens)`: `loaded.model.generate`'s greedy new ids, cut after the
    first EOS, memoised per (prompt ids, max_new_tokens)."""
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in memo:
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = loaded.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=loaded.tokenizer.pad_token_id,
                )[0, ids.shape[1] :].tolist()
            for i, token in enumerate(out):
                if token in loaded.eos_token_ids:
                    out = out[: i + 1]
                    break
            memo[key] = out
        return memo[key]

    return generate
