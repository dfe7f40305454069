"""The real `openai` Python client, unmodified, against `lmiserve serve` on the tiny model, with the
optional API key on."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from helpers.server import run_server

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "What is deep learning?"}]


@pytest.fixture(scope="module")
def url(tiny_model_dir) -> Iterator[str]:
    with run_server(["--model-id", str(tiny_model_dir)], env={"API_KEY": KEY}) as base:
        yield base


@pytest.fixture
def client(url) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30) as c:
        yield c


def test_chat_completion(client):
    completion = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 5 and completion.model == "tiny"


def test_chat_stream_with_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=5, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.total_tokens == whole.usage.total_tokens
    text = "".join(c.choices[0].delta.content for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_logprobs(client):
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_completions(client):
    completion = client.completions.create(model="tiny", prompt="Deep learning is", max_tokens=4, temperature=0)
    assert completion.object == "text_completion" and completion.usage.completion_tokens == 4
    streamed = client.completions.create(
        model="tiny", prompt="Deep learning is", max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text


def test_models_list(client):
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].object == "model"


def test_error_types(client, url):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5000)
    assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
    assert info.value.response.headers["content-type"] == "application/json"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="a", max_tokens=2, top_p=1.5)
    assert info.value.param == "top_p" and "`top_p`" in info.value.message
    with pytest.raises(openai.BadRequestError):  # before the stream starts
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5000, stream=True)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert (not_found.value.code, not_found.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="a", max_tokens=2)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=30) as anonymous:
        with pytest.raises(openai.AuthenticationError):
            anonymous.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)


def _stop_in(text: str) -> str:
    """A stop string the greedy answer `text` contains past its start (two visible characters)."""
    for i in range(1, len(text) - 1):
        if text[i : i + 2].strip() == text[i : i + 2] and text[i : i + 2].isprintable():
            return text[i : i + 2]
    pytest.skip(f"no visible stop string in {text!r}")


def test_the_stop_string_is_left_out_and_finish_reason_is_stop(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    stop = _stop_in(text)
    cut = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop])
    choice = cut.choices[0]
    assert (choice.message.content, choice.finish_reason) == (text[: text.find(stop)], "stop")
    assert choice.model_extra["stop_reason"] == stop  # vLLM's extension: the matched string
    kept = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].message.content == text[: text.find(stop) + len(stop)]
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == text[: text.find(stop)]
    assert chunks[-1].finish_reason == "stop" and all(stop not in (c.delta.content or "") for c in chunks)


def test_completions_stop_and_finish_reasons(client):
    whole = client.completions.create(model="tiny", prompt="Deep learning is", max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length")
    text = whole.choices[0].text
    stop = _stop_in(text)
    cut = client.completions.create(model="tiny", prompt="Deep learning is", max_tokens=12, temperature=0, stop=stop)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (text[: text.find(stop)], "stop")
    streamed = list(
        client.completions.create(
            model="tiny", prompt="Deep learning is", max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == text[: text.find(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_with_n_is_reproducible_and_each_choice_has_its_own_stream(client):
    def texts(seed: int, n: int) -> list[str]:
        completion = client.completions.create(
            model="tiny",
            prompt="The quick brown",
            max_tokens=6,
            n=n,
            seed=seed,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in completion.choices]

    two = texts(11, 2)
    assert two == texts(11, 2) and two[0] != two[1]
    assert texts(11, 1) == two[:1] and texts(12, 1) == two[1:]  # choice i samples from seed + i


def test_logit_bias_forces_a_token_and_bad_words_ban_it(client):
    fox = 473  # " fox" in the tiny model's tokenizer (tests/helpers/tiny_model.py)
    args = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 3, "temperature": 0}
    forced = client.completions.create(**args, logit_bias={str(fox): 100})
    assert forced.choices[0].text == " fox fox fox"
    banned = client.completions.create(**args, logit_bias={str(fox): 100}, extra_body={"bad_words": ["fox"]})
    assert not banned.choices[0].text.startswith(" fox")


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 5},
        {"top_p": 0},
        {"presence_penalty": 3},
        {"logit_bias": {"5": 101}},
        {"logit_bias": {"99999999": 1}},
    ],
)
def test_out_of_range_sampling_fields_raise_bad_request(client, fields):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **fields)
    assert info.value.body["param"] == next(iter(fields))


def test_completions_stream_carries_usage_only_when_asked(client):
    args = {"model": "tiny", "prompt": ["Deep learning is", "Hello"], "max_tokens": 3, "temperature": 0}
    whole = client.completions.create(**args)
    plain = list(client.completions.create(**args, stream=True))
    assert len(plain) == 6 and all(c.choices and c.usage is None for c in plain)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) == 7 and all(c.choices and c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # every prompt's usage together


def test_stream_options_without_stream_is_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="a", max_tokens=2, stream_options={"include_usage": True})
    assert info.value.body["param"] == "stream_options"
    assert info.value.body["message"] == "Stream options can only be defined when `stream=True`."


def test_ignored_fields_are_named_in_the_warnings_header(client):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=2, user="u-42", metadata={"team": "search"}, store=False
    )
    assert raw.http_response.status_code == 200 and raw.parse().choices[0].finish_reason == "length"
    warning = raw.headers["warnings"]
    assert warning.startswith('299 - "ignored fields: ') and warning.endswith('"')
    assert sorted(warning.removeprefix('299 - "ignored fields: ')[:-1].split(", ")) == ["metadata", "user"]
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="a", max_tokens=2, stream=True, extra_body={"no_such_option": 1}
    )
    assert raw.headers["warnings"] == '299 - "ignored fields: no_such_option"'
    assert [c.choices[0].finish_reason for c in raw.parse()] == [None, "length"]
    raw = client.completions.with_raw_response.create(model="tiny", prompt="a", max_tokens=1)
    assert "warnings" not in raw.headers


def test_a_stop_token_s_text_is_left_out_unless_asked(client):
    fox = 473  # " fox", forced by its logit bias
    args = {"model": "tiny", "max_tokens": 3, "temperature": 0, "logit_bias": {str(fox): 100}}
    cut = client.completions.create(prompt="The quick brown", **args, extra_body={"stop_token_ids": [fox]})
    choice = cut.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == ("", "stop", fox)
    assert cut.usage.completion_tokens == 1
    kept = client.completions.create(
        prompt="The quick brown", **args, extra_body={"stop_token_ids": [fox], "include_stop_str_in_output": True}
    )
    assert (kept.choices[0].text, kept.choices[0].finish_reason) == (" fox", "stop")
    chat = client.chat.completions.create(messages=MESSAGES, **args, extra_body={"stop_token_ids": [fox]})
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == ("", "stop")
    chunks = list(
        client.chat.completions.create(messages=MESSAGES, **args, stream=True, extra_body={"stop_token_ids": [fox]})
    )
    assert [(c.choices[0].delta.content, c.choices[0].finish_reason) for c in chunks] == [("", "stop")]
