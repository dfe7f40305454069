"""Logits processing and sampling of a step's rows.

`sample_rows` samples every row of a step together: the rows that need no processing (greedy, no
penalty, no grammar: the common case) in one batched argmax, the others each processed on the device,
and the tokens, their logprobs and the top-N of the whole step come back to the host in ONE transfer
(on a GPU a sync a row is what a step of many rows would wait on). Nothing else makes the host wait for
the device: the ids a row's processing needs are copied without a wait (engine/host_copy.py), and the
sampled rows are drawn together as `torch.multinomial` draws one token (an exponential variate a token,
the row's probabilities divided by them, the argmax) without its two reads of the row's values on the
host; a row that cannot be drawn from is flagged in the step's one transfer. Every sequence has its own
`torch.Generator` seeded from its seed, so a seeded request samples the same tokens whatever else is
in the batch (and the tokens `torch.multinomial` drew with the same generator). On a GPU the step's
sampled rows are drawn in one kernel instead, each from its seed and the index of the token drawn
(engine/runner/seeded_draw.py: batch-independent too, not torch's variates). Reported logprobs are
the model's own distribution (log-softmax of the raw logits), as TGI and vLLM report them.

A row is processed in vLLM's order: `logit_bias` added, `bad_words` banned, the penalties (repetition:
multiplicative over prompt and output; presence and frequency: additive over the output, OpenAI's
definition; runner/penalties.py), `min_new_tokens` (EOS and stop ids banned), then the warpers when sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.core.step import PromptScores, SampleResult
from lmiserve.engine.host_copy import row_pairs, row_values, to_device
from lmiserve.engine.runner import seeded_draw
from lmiserve.engine.runner.penalties import BookedRow, PenaltyBook, penalize, penalized
from lmiserve.engine.runner.row_threads import each_row
from lmiserve.engine.runner.warpers import NEG_INF, warp, warp_rows

UNDRAWABLE = "no token can be drawn: every token's probability is zero or not finite"


def needs_processing(params: SamplingParams) -> bool:
    return (
        params.do_sample
        or penalized(params)
        or params.min_new_tokens > 0
        or bool(params.logit_bias)
        or bool(params.bad_words_ids)
    )


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing to process and no top-N: the token is the argmax, its logprob the only one
    reported (`greedy_pick` samples such rows)."""
    return not needs_processing(params) and params.top_n_tokens == 0


def banned_ids(params: SamplingParams, eos_token_ids: list[int]) -> list[int]:
    """The ids `min_new_tokens` bans until a sequence has that many tokens: the EOS and stop ids."""
    return eos_token_ids + params.stop_token_ids if params.min_new_tokens else []


def banned_words(params: SamplingParams, output_ids: list[int]) -> list[int]:
    """vLLM's `bad_words`: the last token of each bad word whose other tokens the output ends with (a
    one-token word is always banned)."""
    banned = []
    for word in params.bad_words_ids:
        prefix = word[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and output_ids[len(output_ids) - len(prefix) :] == prefix):
            banned.append(word[-1])
    return banned


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % 2**64)  # choice i of a request samples from seed + i, which may pass 2**64 - 1
    return gen


@dataclass
class Row:
    """One row of a step to sample: its parameters and tokens so far, the ids `min_new_tokens` bans,
    its generator and seed (sampling rows) and, for a constrained row, its logits masked by its grammar."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    banned_ids: list[int]
    generator: torch.Generator | None = None
    masked: torch.Tensor | None = None
    seed: int | None = None  # a GPU draws the step's rows from their seeds at once (seeded_draw.py)
    penalty: BookedRow | None = None  # where a book keeps its request's tokens (runner/penalties.py)


def _processed(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """`_processed_rows` of one row (`logits`: its [vocab] row)."""
    return _processed_rows(logits[None], [row], [0])[0]


def _at_once(device: torch.device) -> bool:
    """Whether a step's sampled rows go through their warpers and their draw together (a GPU: a few
    launches a step), or each row alone from its logits to its token (a CPU: a row's passes over the
    vocabulary stay in the core's cache, where the step's rows together do not, and the rows go over the
    engine's threads). 128 rows of 49,152 tokens at temperature 0.7 on an AMD EPYC: 227 ms a step each
    alone against 270 at once on one thread, 147 against 214 on two
    (benchmarks/results/issue39-sampled-syncs-2026-11-30/cpu_paths.py)."""
    return device.type != "cpu"


Sampled = tuple[list[int], torch.Tensor, torch.Tensor]  # the rows drawn, their tokens, whether undrawable


def _none_drawn(logits: torch.Tensor) -> Sampled:
    return [], logits.new_empty(0, dtype=torch.long), logits.new_empty(0, dtype=torch.bool)


def _sampled_row_by_row(
    logits: torch.Tensor, rows: list[Row], where: list[int], results: list[SampleResult | Exception | None]
) -> Sampled:
    """The sampled rows `where`, each alone (`_at_once`); a row that raises gets its error in `results`."""
    out: list[tuple[torch.Tensor, torch.Tensor] | Exception | None] = [None] * len(where)

    def one(n: int) -> None:
        row = rows[where[n]]
        try:
            probs = warp(_processed(logits[where[n]], row), row.params).softmax(-1)
            out[n] = _draw(probs[None], [row.generator])
        except Exception as exc:  # noqa: BLE001 - this row fails, the step goes on
            out[n] = exc

    generators = [rows[i].generator for i in where]
    if None in generators or len(set(map(id, generators))) < len(generators):
        for n in range(len(where)):  # a generator drawn from twice: in order
            one(n)
    else:
        each_row(one, len(where))
    drawn = [(where[n], result) for n, result in enumerate(out) if isinstance(result, tuple)]
    for n, result in enumerate(out):
        if not isinstance(result, tuple):
            results[where[n]] = result
    if not drawn:
        return _none_drawn(logits)
    return (
        [i for i, _ in drawn],
        torch.cat([token for _, (token, _) in drawn]),
        torch.cat([bad for _, (_, bad) in drawn]),
    )


def _sampled_at_once(
    logits: torch.Tensor, rows: list[Row], where: list[int], results: list[SampleResult | Exception | None]
) -> Sampled:
    """The sampled rows `where` together (`_at_once`): their processing, their warpers and their draw, each
    at once for all of them (a row's error fails them all)."""
    try:
        probs = warp_rows(_processed_rows(logits, rows, where), [rows[i].params for i in where]).softmax(-1)
        seeds = [seed for i in where if (seed := rows[i].seed) is not None]
        if seeded_draw.usable(probs.device) and len(seeds) == len(where):  # (a GPU: one launch for the rows)
            drawn = seeded_draw.draw(probs, seeds, [len(rows[i].output_ids) for i in where])
            if drawn is not None:
                return (where, *drawn)
        return (where, *_draw(probs, [rows[i].generator for i in where]))
    except Exception as exc:  # noqa: BLE001 - the sampled rows fail, the step goes on
        for i in where:
            results[i] = exc
        return _none_drawn(logits)


def _processed_rows(logits: torch.Tensor, rows: list[Row], where: list[int]) -> torch.Tensor:
    """The rows `where` (of `logits`, or a row's `masked` copy) processed, a new tensor on the device: biased,
    their bad words banned, penalized, made finite and, before `min_new_tokens`, their EOS and stop ids
    banned, each step one indexed op over the (row, token) pairs of every row that has it."""
    base = logits.index_select(0, to_device(where, logits.device))
    masks = {j: mask for j, i in enumerate(where) if (mask := rows[i].masked) is not None}  # a grammar's rows
    masked = list(masks)
    if masked:
        base[to_device(masked, base.device)] = torch.stack(list(masks.values()))

    params = [rows[i].params for i in where]
    if any(p.logit_bias for p in params):
        at = row_pairs([list(p.logit_bias) for p in params], base.device)
        base[at] += row_values([list(p.logit_bias.values()) for p in params], base)
    words = [banned_words(rows[i].params, rows[i].output_ids) if rows[i].params.bad_words_ids else [] for i in where]
    if any(words):
        base[row_pairs(words, base.device)] = NEG_INF
    if any(penalized(p) for p in params):
        penalize(
            base,
            params,
            [rows[i].prompt_ids for i in where],
            [rows[i].output_ids for i in where],
            [rows[i].penalty for i in where],
        )
    base = processed_finite(base)
    banned = [rows[i].banned_ids if len(rows[i].output_ids) < rows[i].params.min_new_tokens else [] for i in where]
    if any(banned):
        at = row_pairs(banned, base.device)
        kept = base[at]
        base[at] = NEG_INF
        if masked:  # where a grammar allows nothing but ending, the row may end (on the device)
            restore = torch.zeros(len(where), dtype=torch.bool, device=base.device)
            restore[to_device(masked, base.device)] = True
            restore &= ~torch.isfinite(base).any(-1)
            base[at] = torch.where(restore[at[0]], kept, base[at])
    return base


def processed_finite(logits: torch.Tensor) -> torch.Tensor:
    """Penalties may overflow to inf: keep the ranking, stay finite; a token already removed stays removed
    (the last of `_processed_rows`; a decode graph's sampled rows start from it, runner/graph_sampling.py)."""
    return torch.nan_to_num(logits, nan=NEG_INF, posinf=torch.finfo(logits.dtype).max, neginf=NEG_INF)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each row of `probs` drawn with its generator, and whether the row could not be drawn
    from (a value not finite or negative, or all zero), both on the device. `torch.multinomial`'s draw of
    one token (an exponential variate a token from the generator, the probabilities divided by them, the
    argmax: the same tokens for the same generator), without its two reads of the values on the host."""
    noise = torch.empty_like(probs)
    for row_noise, generator in zip(noise, generators):
        row_noise.exponential_(generator=generator)
    total = probs.sum(-1)  # NaN with a NaN, inf with an inf: two passes, as multinomial's checks
    valid = (total > 0) & (total < float("inf")) & (probs.amin(-1) >= 0)
    return probs.div(noise).argmax(-1), ~valid


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
    logprobs = logits.log_softmax(-1)
    tokens = logits.argmax(-1)  # every row's greedy pick; rows that need more are replaced below
    picked, where = [], []  # processed greedy rows' tokens, and where they go
    drawn_where: list[int] = []  # the sampled rows
    at_once, greedy_where = _at_once(logits.device), []  # (processed greedy rows, at once)
    for i, row in enumerate(rows):
        if row.masked is None and not needs_processing(row.params):
            continue
        try:
            if not needs_processing(row.params):
                picked.append(row.masked.argmax())  # type: ignore[union-attr]
                where.append(i)
            elif row.params.do_sample:
                drawn_where.append(i)  # drawn below
            elif at_once:
                greedy_where.append(i)
            else:
                picked.append(_processed(logits[i], row).argmax())
                where.append(i)
        except Exception as exc:  # noqa: BLE001 - this row fails, the step goes on
            results[i] = exc
    if greedy_where:
        try:
            picked.append(_processed_rows(logits, rows, greedy_where).argmax(-1))
            where += greedy_where
        except Exception as exc:  # noqa: BLE001 - these rows fail, the step goes on
            for i in greedy_where:
                results[i] = exc
    undrawable = None
    if drawn_where:
        sampled = _sampled_at_once if at_once else _sampled_row_by_row
        drawn_where, draws, undrawable = sampled(logits, rows, drawn_where, results)
        if drawn_where:
            picked.append(draws)
    if picked:
        values = torch.cat([pick.view(-1) for pick in picked])
        tokens = tokens.index_put((to_device(where + drawn_where, tokens.device),), values)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top_n = max(row.params.top_n_tokens for row in rows)
    parts = [tokens.to(torch.float64), chosen.to(torch.float64)]
    if top_n > 0:
        top_n = min(top_n, logprobs.shape[-1])
        values, ids = torch.topk(logprobs, top_n)
        parts += [ids.to(torch.float64).flatten(), values.to(torch.float64).flatten()]
    if undrawable is not None:
        parts.append(undrawable.to(torch.float64))
    host = torch.cat(parts).tolist()  # the one transfer of the step (ids are exact in float64)
    count = len(rows)
    for n, i in enumerate(drawn_where):
        if host[len(host) - len(drawn_where) + n]:
            results[i] = ValueError(UNDRAWABLE)
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
    banned = banned_ids(params, eos_token_ids)
    return Row(params, prompt_ids, output_ids, banned, generator, seed=seed if params.do_sample else None)


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


# every stage the eager sampler may run, for every row of the profiling step's sampling (`sample_profile`), and
# OpenAI's largest top_logprobs
PROFILE_SAMPLING = SamplingParams(
    do_sample=True,
    temperature=0.7,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    typical_p=0.95,
    repetition_penalty=1.1,
    top_n_tokens=20,
)


def sample_profile(rows: int, vocab: int, device: torch.device) -> list[SampleResult | Exception]:
    """`sample_rows` over `rows` rows of `vocab` float32 logits, every row `PROFILE_SAMPLING`: the largest
    decode step's sampling, which the KV pool leaves room for too (engine/factory.py's profile; vLLM's runs
    its sampler over max_num_seqs rows), their penalties' book included; each row's result."""
    specs = [sampler_row(PROFILE_SAMPLING, [1, 2], [3], [0], n, None, device) for n in range(rows)]
    book = PenaltyBook()  # (as a runner's, its rows at their most: one a row)
    for spec in specs:
        spec.penalty = BookedRow(book, book.open(spec.prompt_ids, spec.output_ids))
    return sample_rows(torch.zeros((rows, vocab), dtype=torch.float32, device=device), specs)
