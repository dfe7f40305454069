"""Whether a request's KV fits the whole pool: the engine's check before it queues a request, and the
engine process's client's before it sends one (with the pool's figures from the engine's snapshot)."""

from __future__ import annotations

from lmiserve.core.errors import InvalidRequest

__all__ = ["blocks_for_tokens", "check_fits"]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` slots that hold `num_tokens` tokens."""
    return -(-max(0, num_tokens) // block_size)


def check_fits(tokens: int, blocks: int, block_size: int) -> None:
    """InvalidRequest for a request whose KV (prompt + max new tokens: `tokens`) needs more than the whole
    pool of `blocks` blocks of `block_size` tokens."""
    if blocks_for_tokens(tokens, block_size) > blocks:
        raise InvalidRequest(
            f"the prompt and max_new_tokens need the KV cache of {tokens} tokens, more than the whole "
            f"KV cache holds ({blocks * block_size} tokens, kv_cache_memory_bytes)"
        )
