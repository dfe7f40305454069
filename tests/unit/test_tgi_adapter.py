"""TGI request validation: exact messages, their order, defaults and the engine request built from a
valid one. Token counting is a stand-in (one token per word) so each length check can be hit exactly."""

from __future__ import annotations

import json

import pytest

from lmiserve.core.errors import GenerationFailed, InvalidRequest, ModelNotReady, Overloaded
from lmiserve.core.grammar import Grammar
from lmiserve.core.limits import TextGenLimits as TgiLimits
from lmiserve.protocols.textgen.generation import generate
from lmiserve.protocols.textgen.validation import build
from lmiserve.protocols.tgi.errors import RENDERER
from lmiserve.protocols.tgi.schema import GenerateRequest, TgiParameters

LIMITS = TgiLimits(max_input_tokens=10, max_total_tokens=16)


def words(text: str) -> int:
    return len(text.split())


def call(inputs: str = "a b c", stream: bool = False, limits: TgiLimits = LIMITS, **params):
    return build(inputs, TgiParameters(**params), limits, words, stream=stream)


def message(inputs: str = "a b c", stream: bool = False, limits: TgiLimits = LIMITS, **params) -> str:
    with pytest.raises(InvalidRequest) as info:
        call(inputs, stream, limits, **params)
    body = json.loads(RENDERER.body(info.value))
    assert RENDERER.status(info.value) == 422 and body["error_type"] == "validation"
    assert body["error"].startswith("Input validation error: ")
    return body["error"].removeprefix("Input validation error: ")


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ({"best_of": 0}, "`best_of` must be > 0 and <= 2. Given: 0"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"temperature": 0.0}, "`temperature` must be strictly positive"),
        ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
        ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
        ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
        ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        ({"truncate": 0}, "`truncate` must be strictly positive and less than 10. Given: 0"),
        ({"truncate": 11}, "`truncate` must be strictly positive and less than 10. Given: 11"),
        (
            {"grammar": {"type": "xml", "value": "a+"}},
            "unknown grammar type 'xml': expected json, json_object, json_schema or regex",
        ),
    ],
)
def test_messages(params, expected):
    assert message(**params) == expected


def test_grammar_becomes_the_requests_constraint():
    assert call(grammar={"type": "regex", "value": "a+"}).request.params.grammar == Grammar("regex", "a+")


def test_best_of_disabled_by_the_server():
    limits = TgiLimits(max_best_of=1, max_input_tokens=10, max_total_tokens=16)
    assert message(limits=limits, best_of=2, do_sample=True) == "`best_of` != 1 is not allowed for this endpoint"


def test_validation_order_first_error_wins():
    # best_of beats temperature, temperature beats top_p, top_k beats max_new_tokens, stop beats top_n_tokens
    assert message(best_of=3, temperature=0.0) == "`best_of` must be > 0 and <= 2. Given: 3"
    assert message(temperature=-1.0, top_p=2.0) == "`temperature` must be strictly positive"
    assert message(top_k=-1, max_new_tokens=0) == "`top_k` must be strictly positive"
    assert message(stop=["x"] * 5, top_n_tokens=9).startswith("`stop`")


def test_empty_inputs():
    assert message(inputs="") == "`inputs` cannot be empty"


def test_total_length_check_comes_first():
    assert message(inputs=" ".join("w" * 12), max_new_tokens=8) == (
        "`inputs` tokens + `max_new_tokens` must be <= 16. Given: 12 `inputs` tokens and 8 `max_new_tokens`"
    )


def test_input_length_check():
    prompt = " ".join(["w"] * 12)
    assert message(inputs=prompt, max_new_tokens=2) == "`inputs` must have less than 10 tokens. Given: 12"
    # no max_new_tokens: the rest of the budget, so only the input length can fail
    assert message(inputs=prompt) == "`inputs` must have less than 10 tokens. Given: 12"


def test_prompt_longer_than_total_without_max_new_tokens():
    assert message(inputs=" ".join(["w"] * 20)) == (
        "`inputs` tokens + `max_new_tokens` must be <= 16. Given: 20 `inputs` tokens and 0 `max_new_tokens`"
    )


def test_input_equal_to_max_input_is_allowed():
    result = call(inputs=" ".join(["w"] * 10), max_new_tokens=6)
    assert result.input_length == 10


def test_truncate_shortens_the_measured_input():
    result = call(inputs=" ".join(["w"] * 14), truncate=4, max_new_tokens=2)
    assert result.input_length == 4 and result.request.params.truncate == 4


def test_streaming_only_errors():
    assert message(stream=True, best_of=2, do_sample=True) == "`best_of` != 1 is not supported when streaming tokens"
    assert message(stream=True, decoder_input_details=True) == (
        "`decoder_input_details` == true is not supported when streaming tokens"
    )


def test_defaults_greedy_and_max_new_tokens_fill_the_budget():
    result = call()
    p = result.request.params
    assert not result.sampling and not p.do_sample
    assert p.max_new_tokens == 16 - 3
    assert p.include_stop_str_in_output is True  # TGI keeps stop sequences
    assert (p.n, p.best_of, p.top_n_tokens) == (1, 1, 0)
    assert result.details is False and result.return_full_text is False


@pytest.mark.parametrize(
    "params",
    [{"do_sample": True}, {"temperature": 0.5}, {"top_k": 5}, {"top_p": 0.9}, {"typical_p": 0.9}],
)
def test_sampling_is_implied(params):
    assert call(**params).sampling


def test_temperature_one_alone_is_greedy():
    assert not call(temperature=1.0).sampling


def test_parameters_absent_means_do_sample():
    req = GenerateRequest.model_validate({"inputs": "a"})
    assert req.effective_parameters().do_sample is True
    req = GenerateRequest.model_validate({"inputs": "a", "parameters": {}})
    assert req.effective_parameters().do_sample is False


def test_best_of_asks_the_engine_for_every_sequence():
    result = call(best_of=2, do_sample=True, max_new_tokens=3)
    assert (result.request.params.n, result.request.params.best_of) == (2, 2)


def test_decoder_input_details_forces_details():
    result = call(decoder_input_details=True, max_new_tokens=2)
    assert result.details and result.request.params.decoder_input_details


def test_stop_null_is_accepted():
    assert TgiParameters.model_validate({"stop": None}).stop == []


def rendered(exc) -> tuple[int, str, str]:
    body = json.loads(RENDERER.body(exc))
    return RENDERER.status(exc), body["error_type"], body["error"]


class StoppingEngine:
    """An engine that stops under the request (the server shuts down)."""

    async def generate(self, request):
        raise ModelNotReady("gone")
        yield  # an async generator


async def test_core_errors_in_tgi_terms():
    assert rendered(InvalidRequest("bad")) == (422, "validation", "Input validation error: bad")
    assert rendered(Overloaded("full"))[:2] == (429, "overloaded")
    with pytest.raises(GenerationFailed) as info:
        [item async for item in generate(StoppingEngine(), [None])]
    assert rendered(info.value) == (424, "generation", "Request failed during generation: gone")
