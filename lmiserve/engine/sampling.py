"""Logits processing and sampling, one sequence (row) at a time.

Every sequence has its own `torch.Generator` seeded from its seed, so a seeded request samples the
same tokens whatever else is in the batch. Reported logprobs are the model's own distribution
(log-softmax of the raw logits), as TGI and vLLM report them.

A row is processed in vLLM's order: `logit_bias` added, `bad_words` banned, the penalties (repetition:
multiplicative over prompt and output; presence and frequency: additive over the output, OpenAI's
definition), `min_new_tokens` (EOS and stop ids banned), then the warpers when sampling.
"""

from __future__ import annotations

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.scheduler import SampleResult

_NEG_INF = float("-inf")


def needs_processing(params: SamplingParams) -> bool:
    return (
        params.do_sample
        or params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.min_new_tokens > 0
        or bool(params.logit_bias)
        or bool(params.bad_words_ids)
    )


def apply_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """OpenAI's `logit_bias`: each value added to its token's logit (in place)."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def banned_words(params: SamplingParams, output_ids: list[int]) -> list[int]:
    """vLLM's `bad_words`: the last token of each bad word whose other tokens the output ends with (a
    one-token word is always banned)."""
    banned = []
    for word in params.bad_words_ids:
        prefix = word[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and output_ids[len(output_ids) - len(prefix) :] == prefix):
            banned.append(word[-1])
    return banned


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        scores = logits[seen]
        logits[seen] = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
    if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        ids, counts = torch.unique(torch.tensor(output_ids, device=logits.device), return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    return logits


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """temperature, top_k, top_p, min_p, typical_p (in the order transformers applies them)."""
    if params.temperature != 1.0:
        logits = logits / params.temperature
    # extreme temperatures or penalties overflow to inf: keep the ranking, stay finite
    logits = torch.nan_to_num(logits, nan=_NEG_INF, posinf=torch.finfo(logits.dtype).max)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, _NEG_INF)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - params.top_p)
        remove[-1] = False
        logits = logits.masked_fill(remove.scatter(0, order, remove), _NEG_INF)
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), _NEG_INF)
    if params.typical_p < 1.0:
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp).nansum()
        shifted = (-logp - entropy).abs()
        sorted_shift, order = torch.sort(shifted)
        cumulative = logits.softmax(-1)[order].cumsum(-1)
        last = min(int((cumulative < params.typical_p).sum()), logits.shape[-1] - 1)
        remove = sorted_shift > sorted_shift[last]
        logits = logits.masked_fill(remove.scatter(0, order, remove), _NEG_INF)
    return logits


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % 2**64)  # choice i of a request samples from seed + i, which may pass 2**64 - 1
    return gen


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    banned_ids: list[int],
    generator: torch.Generator | None,
    masked: torch.Tensor | None = None,
) -> SampleResult:
    """Pick the next token of one sequence from its raw logits row (float32, shape [vocab]); from
    `masked` (the same row with the tokens its grammar disallows at -inf) when it is constrained.
    Logprobs are always those of the raw row."""
    logprobs = logits.log_softmax(-1)
    source = logits if masked is None else masked
    if needs_processing(params):
        processed = apply_bias(source.clone(), params)
        words = banned_words(params, output_ids) if params.bad_words_ids else []
        if words:
            processed[words] = _NEG_INF
        processed = apply_penalties(processed, params, prompt_ids, output_ids)
        processed = torch.nan_to_num(processed, nan=_NEG_INF, posinf=torch.finfo(processed.dtype).max)
        if banned_ids and len(output_ids) < params.min_new_tokens:
            kept = processed[banned_ids]
            processed[banned_ids] = _NEG_INF
            if masked is not None and not bool(torch.isfinite(processed).any()):
                processed[banned_ids] = kept  # the grammar allows nothing but ending
        if params.do_sample:
            probs = warp(processed, params).softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=generator).item())
        else:
            token = int(processed.argmax().item())
    else:
        token = int(source.argmax().item())
    top = None
    if params.top_n_tokens > 0:
        values, ids = torch.topk(logprobs, min(params.top_n_tokens, logprobs.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist()))
    return SampleResult(token, float(logprobs[token].item()), top)
