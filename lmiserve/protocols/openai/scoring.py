"""Scoring prompts on /v1/completions (what lm-eval's loglikelihood tasks send) and the logprob limits.

- ``prompt``: a string, a list of strings, a list of token ids or a list of token-id lists. Token ids
  are used as given (no BOS added); one outside the vocabulary is refused by the engine (400). The
  echoed text of a token-id prompt is its decoding, special tokens left out.
- ``echo`` with ``logprobs: N``: ``logprobs`` covers the prompt then the generated tokens; the first
  prompt token has ``null`` logprob and top logprobs; every other token a dict of the N most likely
  tokens at its position plus the token itself (N or N + 1 entries; ``logprobs: 0``: the token alone),
  as OpenAI and vLLM answer.
- ``max_tokens: 0`` with ``echo`` scores the prompt only (the engine samples one token, which is left
  out of the text, the logprobs and ``usage``); without ``echo`` it is a 400, as in vLLM.
- vLLM's ``prompt_logprobs: K``: per choice, ``null`` for the first prompt token, then for each prompt
  token a dict token id -> ``{"logprob", "rank", "decoded_token"}`` of the token itself (its rank among
  all tokens) and the K most likely tokens there (ranks 1..K).
- ``logprobs`` (completions), ``top_logprobs`` (chat) and ``prompt_logprobs`` above the server's
  ``max_logprobs`` (vLLM's name, default 20) are refused with a 400 naming the limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.events import Finish, Token
from lmiserve.core.limits import TextGenLimits
from lmiserve.protocols.openai.errors import EmptyPrompt

LOGPROB_FLOOR = -9999.0  # vLLM's: -inf is not JSON

Decode = Callable[[list[int]], str]  # token ids -> text, special tokens left out


@dataclass(frozen=True)
class Prompt:
    """One prompt of a completions request: its text and, when it was given as token ids, those."""

    text: str
    ids: list[int] | None = None

    @property
    def checked_text(self) -> str:
        """What TGI's checks see (never empty for token ids, whose text may be: special tokens only)."""
        return self.text or (str(self.ids) if self.ids is not None else "")

    def counter(self, count_tokens: Callable[[str], int]) -> Callable[[str], int]:
        """Token counting for TGI's checks: the given ids' number for a token-id prompt."""
        if self.ids is None:
            return count_tokens
        length = len(self.ids)
        return lambda _text: length


def prompts(raw: str | Sequence[Any], decode: Decode | None) -> list[Prompt]:
    """The prompts of a (schema-checked) completions ``prompt``; `EmptyPrompt` for an empty one. `decode`
    raises `InvalidRequest` for a token id outside the vocabulary."""
    if isinstance(raw, str):
        return [Prompt(raw)]
    items: list[Any] = [list(raw)] if raw and all(isinstance(x, int) for x in raw) else list(raw)
    if not items:
        raise EmptyPrompt("Empty array detected. Do not use an empty array for the prompt.")
    found = []
    for item in items:
        if isinstance(item, str):
            found.append(Prompt(item))
            continue
        if not item:
            raise EmptyPrompt("Empty array detected. Do not use an empty array for the prompt.")
        ids = [int(i) for i in item]
        found.append(Prompt(decode(ids) if decode is not None else "", ids))
    return found


def check_limit(name: str, value: int | None, limits: TextGenLimits) -> None:
    """`InvalidRequest` when `value` asks for more logprobs than the server's `max_logprobs`."""
    if value is not None and value > limits.max_logprobs:
        raise InvalidRequest(f"`{name}` must be <= {limits.max_logprobs} (the server's max_logprobs). Given: {value}")


def score_only(req: Any) -> bool:
    """``max_tokens: 0`` with ``echo``: the prompt is scored, nothing generated is answered."""
    return req.max_tokens == 0 and bool(req.echo)


def check(req: Any, limits: TextGenLimits) -> None:
    """The completions request's scoring fields: limits, ``max_tokens: 0``, ``prompt_logprobs``."""
    check_limit("logprobs", req.logprobs, limits)
    check_limit("prompt_logprobs", req.prompt_logprobs, limits)
    if req.max_tokens == 0 and not req.echo:
        raise InvalidRequest("`max_tokens` must be at least 1, got 0 (0 needs `echo`: the prompt scored alone)")
    if req.max_tokens == 0 and req.stream:
        raise InvalidRequest("`max_tokens` 0 (the prompt scored alone) is not supported when streaming")
    if req.prompt_logprobs is not None and req.stream:
        raise InvalidRequest("`prompt_logprobs` is not supported when streaming")


def chat_prompt_logprobs(req: Any, limits: TextGenLimits) -> dict[str, Any]:
    """vLLM's `prompt_logprobs` on chat: the rendered prompt's tokens scored (not with `stream`), as the
    engine's `SamplingParams` fields."""
    if req.prompt_logprobs is None:
        return {}
    check_limit("prompt_logprobs", req.prompt_logprobs, limits)
    if req.stream:
        raise InvalidRequest("`prompt_logprobs` is not supported when streaming")
    return {"decoder_input_details": True, "prompt_top_n": req.prompt_logprobs}


def max_new_tokens(req: Any) -> int | None:
    """The engine's max_new_tokens: one (then dropped) when only the prompt is scored."""
    return 1 if score_only(req) else req.max_tokens


def logprob_fields(req: Any, top_n: int) -> dict[str, Any]:
    """What TGI's checks do not know of a completions request, as the engine's `SamplingParams` fields:
    the top-N of each generated token (the limit is `max_logprobs`, checked before) and of each prompt
    position. (A prompt of token ids is the request's `prompt_ids`: `Prompt.ids`.)"""
    fields: dict[str, Any] = {"top_n_tokens": top_n, "prompt_top_n": None}
    echo_scores = bool(req.echo) and req.logprobs is not None and not req.stream
    if echo_scores or req.prompt_logprobs is not None:
        fields["decoder_input_details"] = True
        fields["prompt_top_n"] = max((req.logprobs or 0) if echo_scores else 0, req.prompt_logprobs or 0)
    return fields


# --- rendering ------------------------------------------------------------------------------------------


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def top_dict(token: Token, top: Sequence[Token] | None, n: int) -> dict[str, float] | None:
    """The legacy ``top_logprobs`` entry of a token: the token itself and the `n` most likely (None for
    a token without logprob: the first of the prompt)."""
    if token.logprob is None:
        return None
    same = next((c for c in top or () if c.id == token.id), None)  # its text decoded alone, as the others
    entry = {(same or token).text: _lp(token.logprob)}
    for candidate in (top or ())[:n]:
        if candidate.logprob is not None:
            entry.setdefault(candidate.text, _lp(candidate.logprob))
    return entry


def echoed_prompt(finish: Finish) -> tuple[list[Token], list[tuple[Token, ...] | None]]:
    """The prompt tokens of an echo with logprobs (the first one's logprob None) and their top tokens."""
    prefill = finish.prefill or ()
    tokens = [Token(t.id, t.text, None if i == 0 else t.logprob, t.special) for i, t in enumerate(prefill)]
    tops: list[tuple[Token, ...] | None] = (
        list(finish.prefill_top) if finish.prefill_top is not None else [None] * len(tokens)
    )
    return tokens, tops


def prompt_logprobs(finish: Finish, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: None for the first prompt token, then per token its own
    entry (logprob, rank among all tokens, decoded text) and the `k` most likely tokens (ranks 1..k)."""
    prefill = finish.prefill or ()
    ranks = finish.prefill_ranks or (None,) * len(prefill)
    tops = finish.prefill_top or (None,) * len(prefill)
    rendered: list[dict[str, dict[str, Any]] | None] = []
    for i, (token, rank, top) in enumerate(zip(prefill, ranks, tops)):
        if i == 0 or token.logprob is None:
            rendered.append(None)
            continue
        entry = {str(token.id): {"logprob": _lp(token.logprob), "rank": rank, "decoded_token": token.text}}
        for place, candidate in enumerate((top or ())[:k], start=1):
            if candidate.logprob is not None:
                entry.setdefault(
                    str(candidate.id),
                    {"logprob": _lp(candidate.logprob), "rank": place, "decoded_token": candidate.text},
                )
        rendered.append(entry)
    return rendered
