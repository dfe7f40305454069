"""Logits processing and sampling of a step's rows.

`sample_rows` samples every row of a step together: the rows that need no processing (greedy, no
penalty, no grammar: the common case) in one batched argmax, the others each processed on the device,
and the tokens, their logprobs and the top-N of the whole step come back to the host in ONE transfer
(on a GPU a sync a row is what a step of many rows would wait on). Every sequence has its own
`torch.Generator` seeded from its seed, so a seeded request samples the same tokens whatever else is
in the batch. Reported logprobs are the model's own distribution (log-softmax of the raw logits), as
TGI and vLLM report them.

A row is processed in vLLM's order: `logit_bias` added, `bad_words` banned, the penalties (repetition:
multiplicative over prompt and output; presence and frequency: additive over the output, OpenAI's
definition), `min_new_tokens` (EOS and stop ids banned), then the warpers when sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.core.step import PromptScores, SampleResult

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


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing to process and no top-N: the token is the argmax, its logprob the only one
    reported (`greedy_pick` samples such rows)."""
    return not needs_processing(params) and params.top_n_tokens == 0


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
        logits = _top_p(logits, params.top_p)
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


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' `TopPLogitsWarper`: the likeliest tokens whose probabilities, the less likely ones first,
    add up to more than ``1 - top_p`` are kept (the likeliest always). On a GPU by its ascending sort of the
    whole vocabulary; on a CPU, where that sort costs ~5 ms a token at 49,152 tokens, from the likeliest
    tokens only (`topk` of 256, then of 8,192, until the kept ones end inside them; else the sort): a token
    is kept while the tokens likelier than it hold less than `top_p` (in float64). The 8,192 are skipped
    where the 256 show that they cannot hold the nucleus (a flat distribution: the sort at once)."""
    if logits.device.type == "cpu" and logits.shape[-1] > 8192:
        probs = logits.to(torch.float64).softmax(-1)
        for k in (256, 8192):
            top, ids = torch.topk(probs, k)  # sorted, the likeliest first
            before = top.cumsum(-1) - top  # what the tokens likelier than each hold
            kept = max(int((before < top_p).sum()), 1)
            if kept < k:
                keep = ids[:kept]
                return torch.full_like(logits, _NEG_INF).index_copy_(0, keep, logits[keep])
            held, least = float(before[-1] + top[-1]), float(top[-1])
            if k == 256 and least > 0 and k + (top_p - held) / least > 8192:
                break  # the tokens after these hold at most `least` each: the nucleus is longer than 8,192
    sorted_logits, order = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative <= (1 - top_p)
    remove[-1] = False
    return logits.masked_fill(remove.scatter(0, order, remove), _NEG_INF)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % 2**64)  # choice i of a request samples from seed + i, which may pass 2**64 - 1
    return gen


@dataclass
class Row:
    """One row of a step to sample: its parameters and tokens so far, the ids `min_new_tokens` bans,
    its generator (sampling rows) and, for a constrained row, its logits masked by its grammar."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    banned_ids: list[int]
    generator: torch.Generator | None = None
    masked: torch.Tensor | None = None


def _choose(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """The chosen token of a row that needs processing or is masked, as a 0-d tensor on the device (no
    transfer to the host)."""
    params, source = row.params, (logits if row.masked is None else row.masked)
    if not needs_processing(params):
        return source.argmax()
    processed = apply_bias(source.clone(), params)
    words = banned_words(params, row.output_ids) if params.bad_words_ids else []
    if words:
        processed[words] = _NEG_INF
    processed = apply_penalties(processed, params, row.prompt_ids, row.output_ids)
    processed = torch.nan_to_num(processed, nan=_NEG_INF, posinf=torch.finfo(processed.dtype).max)
    if row.banned_ids and len(row.output_ids) < params.min_new_tokens:
        kept = processed[row.banned_ids]
        processed[row.banned_ids] = _NEG_INF
        if row.masked is not None and not bool(torch.isfinite(processed).any()):
            processed[row.banned_ids] = kept  # the grammar allows nothing but ending
    if params.do_sample:
        probs = warp(processed, params).softmax(-1)
        return torch.multinomial(probs, 1, generator=row.generator)[0]
    return processed.argmax()


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token and its logprob, float64 ``[rows, 2]`` (ids are exact in float64): the
    sampling of a step whose rows are all plain greedy, computed on the device as `sample_rows` computes
    it (the CUDA graphs compute it inside each decode graph, engine/attention/cuda_graphs.py, and the
    runner takes it as the step's one transfer: runner/in_flight.py)."""
    tokens = logits.argmax(-1, keepdim=True)
    chosen = logits.log_softmax(-1).gather(1, tokens)
    return torch.cat((tokens.to(torch.float64), chosen.to(torch.float64)), dim=1)


def sample_rows(logits: torch.Tensor, rows: list[Row]) -> list[SampleResult | Exception]:
    """Pick the next token of each row from its raw logits row (`logits`: float32, [len(rows), vocab]);
    a constrained row from its `masked` copy. Logprobs are always those of the raw rows. A row whose
    processing raises gets its exception in its place; the others are sampled. The step's tokens,
    logprobs and top-N reach the host in one transfer."""
    results: list[SampleResult | Exception | None] = [None] * len(rows)
    if not rows:
        return []
    special = [i for i, row in enumerate(rows) if row.masked is not None or needs_processing(row.params)]
    logprobs = logits.log_softmax(-1)
    tokens = logits.argmax(-1)  # every row's greedy pick; rows that need more are replaced below
    if special:
        picked, where = [], []
        for i in special:
            try:
                picked.append(_choose(logits[i], rows[i]))
                where.append(i)
            except Exception as exc:  # noqa: BLE001 - this row fails, the step goes on
                results[i] = exc
        if picked:
            tokens = tokens.index_put((torch.tensor(where, device=tokens.device),), torch.stack(picked))
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top_n = max(row.params.top_n_tokens for row in rows)
    parts = [tokens.to(torch.float64), chosen.to(torch.float64)]
    if top_n > 0:
        top_n = min(top_n, logprobs.shape[-1])
        values, ids = torch.topk(logprobs, top_n)
        parts += [ids.to(torch.float64).flatten(), values.to(torch.float64).flatten()]
    host = torch.cat(parts).tolist()  # the one transfer of the step (ids are exact in float64)
    count = len(rows)
    for i, row in enumerate(rows):
        if results[i] is not None:
            continue
        top = None
        if row.params.top_n_tokens > 0:
            n, base = min(row.params.top_n_tokens, top_n), 2 * count + i * top_n
            ids_at, values_at = base, base + count * top_n
            top = [(int(host[ids_at + j]), host[values_at + j]) for j in range(n)]
        results[i] = SampleResult(int(host[i]), host[count + i], top)
    return [r for r in results if r is not None]


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    banned_ids: list[int],
    generator: torch.Generator | None,
    masked: torch.Tensor | None = None,
) -> SampleResult:
    """`sample_rows` of one row (`logits`: [vocab]); raises what its processing raises."""
    result = sample_rows(logits[None], [Row(params, prompt_ids, output_ids, banned_ids, generator, masked)])[0]
    if isinstance(result, Exception):
        raise result
    return result


def sampler_row(
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    eos_token_ids: list[int],
    seed: int | None,
    generator: torch.Generator | None,
    device: torch.device | None = None,
) -> Row:
    """What the sampler needs of one sequence: `min_new_tokens` bans the EOS and stop ids; a sampled
    sequence's generator is made from its seed on its first token (`Row.generator`, for the caller to
    keep) on `device`."""
    if params.do_sample and generator is None:
        if seed is None:
            raise ValueError("a sampled sequence needs a seed")
        generator = make_generator(seed, device if device is not None else torch.device("cpu"))
    banned = eos_token_ids + params.stop_token_ids if params.min_new_tokens else []
    return Row(params, prompt_ids, output_ids, banned, generator)


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: list[int], start: int, end: int, top_n: int | None = None
) -> PromptScores:
    """Logprob of each prompt token given the ones before it, from the logits rows of prompt positions
    ``start..end-1``; the first prompt token has none. With `top_n` (not None) also each token's rank (1 +
    the number of tokens the model found more likely) and the `top_n` most likely tokens at its position."""
    targets = prompt_ids[start + 1 : min(end + 1, len(prompt_ids))]
    logprobs = logits[: len(targets)].log_softmax(-1)
    chosen = logprobs[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)]
    values: list[float | None] = chosen.tolist()
    ranks: list[int | None] | None = None
    tops: list[list[tuple[int, float]] | None] | None = None
    if top_n is not None:
        ranks = ((logprobs > chosen[:, None]).sum(-1) + 1).tolist()
        best, ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]))
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), best.tolist())]
    if start == 0:
        return PromptScores(
            0, [None, *values], None if ranks is None else [None, *ranks], None if tops is None else [None, *tops]
        )
    return PromptScores(start + 1, values, ranks, tops)
