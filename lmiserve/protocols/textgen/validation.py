"""Generation parameters -> one engine request, validated in TGI's order with TGI's messages.

Every failure raises `InvalidRequest` with the detail only; the protocols' renderers add TGI's
``Input validation error: `` prefix. OpenAI requests are mapped onto `TextGenParameters` and
validated here too. `check` validates; `Checked.call` then builds the engine request once, immutable,
with what the protocol adds (the adapter, OpenAI's fields, a grammar, ...); `build` does both for TGI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmiserve.core import constraints
from lmiserve.core.errors import ContextLengthExceeded, InvalidRequest
from lmiserve.core.limits import TextGenLimits
from lmiserve.core.media import Image
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.protocols.textgen.parameters import TextGenParameters


@dataclass(frozen=True)
class TextGenCall:
    """A validated request: what the engine runs (complete, immutable) and what the answer must show."""

    request: GenerationRequest
    details: bool
    return_full_text: bool
    input_length: int
    sampling: bool

    @property
    def best_of(self) -> int:
        return self.request.params.best_of

    @property
    def top_n_tokens(self) -> int:
        return self.request.params.top_n_tokens

    @property
    def decoder_input_details(self) -> bool:
        return self.request.params.decoder_input_details


@dataclass(frozen=True)
class Checked:
    """A request that passed TGI's checks: the engine's parameters as TGI's fields give them (`params`)
    and what the answer shows. `call` builds the engine request, once, with what the protocol adds."""

    inputs: str
    params: SamplingParams
    priority: int
    details: bool
    return_full_text: bool
    input_length: int
    sampling: bool

    def call(
        self,
        *,
        adapter: str | None = None,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        priority: int | None = None,
        cache_salt: str | None = None,
        ranked: bool = True,
        images: tuple[Image, ...] = (),
        **sampling: Any,
    ) -> TextGenCall:
        """The validated call: the engine request built with the LoRA adapter that answers (None: the base
        model), the prompt as token ids (`prompt`: their text), the scheduling fields, and `sampling`: the
        `SamplingParams` fields the protocol sets beyond TGI's (OpenAI's penalties, its grammar, ...);
        `images`: a vision model's images, in the order of the prompt's image placeholders."""
        params = dataclasses.replace(self.params, **sampling) if sampling else self.params
        request = GenerationRequest(
            self.inputs if prompt is None else prompt,
            params,
            priority=self.priority if priority is None else priority,
            cache_salt=cache_salt,
            prompt_ids=prompt_ids,
            ranked=ranked,
            adapter=adapter,
            images=images,
        )
        length = self.input_length if prompt_ids is None else len(prompt_ids)
        return TextGenCall(request, self.details, self.return_full_text, length, self.sampling)


def build(
    inputs: str,
    params: TextGenParameters,
    limits: TextGenLimits,
    count_tokens: Callable[[str], int],
    *,
    stream: bool,
    adapter: str | None = None,
) -> TextGenCall:
    """`check`, then the engine request built with nothing more than TGI's fields and the LoRA `adapter`."""
    return check(inputs, params, limits, count_tokens, stream=stream).call(adapter=adapter)


def check(
    inputs: str,
    params: TextGenParameters,
    limits: TextGenLimits,
    count_tokens: Callable[[str], int],
    *,
    stream: bool,
) -> Checked:
    """Validate in TGI's order (the first failing check wins); the engine's parameters. An unset
    `return_full_text` means false."""
    p = params
    best_of = 1 if p.best_of is None else p.best_of
    sampling_set = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
    if p.best_of is not None:
        if limits.max_best_of == 1 and best_of != 1:
            raise InvalidRequest("`best_of` != 1 is not allowed for this endpoint")
        if best_of == 0 or best_of > limits.max_best_of:
            raise InvalidRequest(f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}")
        if best_of > 1 and not sampling_set:
            raise InvalidRequest("you must use sampling when `best_of` is > 1")
    if p.temperature is not None and p.temperature <= 0:
        raise InvalidRequest("`temperature` must be strictly positive")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise InvalidRequest("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise InvalidRequest("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise InvalidRequest("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise InvalidRequest("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise InvalidRequest("`top_k` must be strictly positive")
    if p.max_new_tokens == 0:
        raise InvalidRequest("`max_new_tokens` must be strictly positive")
    if len(p.stop) > limits.max_stop_sequences:
        raise InvalidRequest(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(p.stop)}")
    if best_of > 1 and p.seed is not None:
        raise InvalidRequest("`seed` must not be set when `best_of` > 1")
    top_n = p.top_n_tokens or 0
    if top_n > limits.max_top_n_tokens:
        raise InvalidRequest(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {top_n}")
    if not inputs:
        raise InvalidRequest("`inputs` cannot be empty")
    if p.truncate is not None and (p.truncate == 0 or p.truncate > limits.max_input_tokens):
        raise InvalidRequest(
            f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. Given: {p.truncate}"
        )
    input_length = count_tokens(inputs)
    if p.truncate is not None:
        input_length = min(input_length, p.truncate)
    max_new = p.max_new_tokens if p.max_new_tokens is not None else max(limits.max_total_tokens - input_length, 0)
    check_lengths(input_length, max_new, limits)
    grammar = constraints.from_tgi(p.grammar) if p.grammar is not None else None
    if stream and best_of != 1:
        raise InvalidRequest("`best_of` != 1 is not supported when streaming tokens")
    if stream and p.decoder_input_details:
        raise InvalidRequest("`decoder_input_details` == true is not supported when streaming tokens")

    sampling = p.do_sample or (
        (p.temperature is not None and p.temperature != 1.0)
        or (p.top_k is not None and p.top_k != 0)
        or (p.top_p is not None and p.top_p < 1.0)
        or (p.typical_p is not None and p.typical_p < 1.0)
    )
    sampling_params = SamplingParams(
        do_sample=sampling,
        seed=p.seed,
        temperature=p.temperature if p.temperature is not None else 1.0,
        top_k=p.top_k or 0,
        top_p=p.top_p if p.top_p is not None else 1.0,
        typical_p=p.typical_p if p.typical_p is not None else 1.0,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        max_new_tokens=max_new,
        stop_sequences=list(p.stop),
        include_stop_str_in_output=True,  # TGI keeps stop sequences in the output
        truncate=p.truncate,
        decoder_input_details=p.decoder_input_details,
        top_n_tokens=top_n,
        n=best_of,
        best_of=best_of,
        grammar=grammar,
    )
    full_text = p.return_full_text if p.return_full_text is not None else False
    return Checked(
        inputs=inputs,
        params=sampling_params,
        priority=p.priority or 0,
        details=p.details or p.decoder_input_details,
        return_full_text=full_text,
        input_length=input_length,
        sampling=sampling,
    )


def check_lengths(input_length: int, max_new: int, limits: TextGenLimits) -> None:
    """The total check first, then the input length (equal to max_input_tokens is allowed)."""
    figures = {
        "input_tokens": input_length,
        "max_new_tokens": max_new,
        "max_total": limits.max_total_tokens,
        "max_input": limits.max_input_tokens,
    }
    if input_length + max_new > limits.max_total_tokens:
        raise ContextLengthExceeded(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new} `max_new_tokens`",
            **figures,
        )
    if input_length > limits.max_input_tokens:
        raise ContextLengthExceeded(
            f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {input_length}", **figures
        )
