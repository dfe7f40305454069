"""The reasoning presets in each family's format (lmiserve.protocols.textgen.reasoning): Granite 3.2's
phrases (and their ``Here's`` spelling), gpt-oss's harmony analysis channel with its special tokens'
text, Magistral's ``[THINK]``, an end-only preset, each split at every point; the markers a setting
overrides; the budgets: OpenAI's `reasoning_effort` mapped through `reasoning_effort_budgets` (unless the
template reads it), Anthropic's `thinking`, and what reaches the engine over HTTP on the scripted fake.
The engine's side: tests/unit/test_thinking_budget.py."""

from __future__ import annotations

import functools
import typing

import pytest

from helpers.text_app import Script, text_app
from helpers.tiny_model import build_thinking_tokenizer
from lmiserve.config import Settings
from lmiserve.config.settings import REASONING_PRESETS, ReasoningParser, parse_effort_budgets
from lmiserve.core.request import ThinkingBudget
from lmiserve.protocols.textgen.reasoning import Reasoning, effort_budget, markers, opened_in, reads_effort

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GPT_OSS_ANSWER = (
    "<|channel|>analysis<|message|>The user asks for the capital.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris."
)


def preset(name: str, **settings) -> Reasoning:
    marks = markers(Settings(reasoning_parser=name, **settings))
    assert marks is not None
    return Reasoning(marks, inside=False)


def every_split(reasoning: Reasoning, text: str) -> set[tuple[str, str]]:
    """The (reasoning, content) of `text` fed in two pieces, for every cut (and token by character)."""
    results = set()
    for at in range(len(text) + 1):
        splitter = reasoning.splitter()
        pieces = [splitter.token(text[:at]), splitter.token(text[at:]), splitter.flush()]
        results.add(("".join(r for r, _ in pieces), "".join(c for _, c in pieces)))
    splitter = reasoning.splitter()
    pieces = [splitter.token(ch) for ch in text] + [splitter.flush()]
    results.add(("".join(r for r, _ in pieces), "".join(c for _, c in pieces)))
    return results


def test_every_preset_is_a_setting_value_and_vllm_names_are_kept():
    assert set(REASONING_PRESETS) == set(typing.get_args(ReasoningParser))
    for name in ("deepseek_r1", "qwen3", "glm45", "ernie45", "seed_oss", "minimax_m2", "hunyuan_a13b", "mistral"):
        assert name in REASONING_PRESETS
    assert {"granite", "openai_gptoss"} <= set(REASONING_PRESETS)
    assert Settings.from_options({"reasoning_parser": "Granite"}).reasoning_parser == "granite"


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (
            "granite",
            "Here is my thought process:\nThe capital is Paris.\nHere is my response:\nParis.",
            ("\nThe capital is Paris.\n", "Paris."),
        ),
        (  # the other spelling vLLM reads too
            "granite",
            "Here's my thought process: Paris, surely. Here's my response: Paris.",
            (" Paris, surely. ", "Paris."),
        ),
        ("granite", "Paris is the capital.", ("", "Paris is the capital.")),  # no thinking
        ("openai_gptoss", GPT_OSS_ANSWER, ("The user asks for the capital.", GPT_OSS_ANSWER.split("<|end|>")[1])),
        ("mistral", "[THINK]Paris, surely.[/THINK]Paris.", ("Paris, surely.", "Paris.")),
        ("seed_oss", "<seed:think>hmm</seed:think>Paris.", ("hmm", "Paris.")),
    ],
)
def test_each_family_split_at_every_point(name, text, expected):
    assert every_split(preset(name), text) == {expected}


def test_whole_answers_and_token_counts_of_the_families():
    granite = preset("granite")
    assert granite.split("Here is my thought process: a Here is my response: b") == (" a ", "b")
    assert granite.split("Here is my thought process: never answered") == (" never answered", None)
    assert granite.tokens(["Here is my thought process:", " a", " b", "Here is my", " response:", " c"]) == 4
    gpt_oss = preset("openai_gptoss")
    tokens = ["<|channel|>", "analysis", "<|message|>", "Think", ".", "<|end|>", "<|start|>", "assistant"]
    assert gpt_oss.tokens(tokens) == 3  # "Think", ".", "<|end|>"
    # the special tokens' text skipped (the default skip_special_tokens): no markers, all content
    assert gpt_oss.split("analysisThink.assistantfinalParis.") == (None, "analysisThink.assistantfinalParis.")
    step3 = Reasoning(markers(Settings(reasoning_parser="step3")), inside=True)  # end-only: always inside
    assert step3.split("hmm</think>Paris.") == ("hmm", "Paris.")


def test_where_each_block_starts():
    granite = markers(Settings(reasoning_parser="granite"))
    # Granite 3.2's thinking system prompt names both phrases: the output does not start inside
    system = "Write your thoughts after 'Here is my thought process:' and your answer after 'Here is my response:'."
    assert not opened_in(f"<|system|>{system}<|assistant|>", granite)
    assert opened_in("<|assistant|>Here's my thought process:", granite)
    gpt_oss = markers(Settings(reasoning_parser="openai_gptoss"))
    assert not opened_in("<|start|>assistant", gpt_oss)
    assert opened_in("<|start|>assistant<|channel|>analysis<|message|>", gpt_oss)
    assert opened_in("<|assistant|>", markers(Settings(reasoning_parser="step3")))


def test_settings_override_a_presets_markers_and_its_other_spellings():
    marks = markers(Settings(reasoning_parser="granite", reasoning_end="ANSWER:"))
    assert marks is not None and marks.ends == ("ANSWER:",) and marks.starts[0] == "Here is my thought process:"
    assert marks.close == ""
    gpt_oss = markers(Settings(reasoning_parser="openai_gptoss"))
    assert gpt_oss is not None and gpt_oss.close == "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert markers(Settings()) is None


# --- budgets --------------------------------------------------------------------------------------------


def test_a_budget_carries_the_block_as_the_engine_follows_it():
    assert preset("qwen3").budget(None) is None
    assert preset("qwen3").budget(5) == ThinkingBudget(5, "</think>", ("</think>",), ("<think>",), inside=False)
    granite = preset("granite").budget(0)
    assert granite is not None and granite.ends == ("Here is my response:", "Here's my response:")
    gpt_oss = preset("openai_gptoss").budget(64)
    assert gpt_oss is not None and gpt_oss.close.startswith("<|end|>") and gpt_oss.ends == ("<|end|>",)


def test_effort_budgets_setting():
    assert parse_effort_budgets("minimal:256,low:1024,medium:none,high:none") == {
        "none": 0,
        "minimal": 256,
        "low": 1024,
        "medium": None,
        "high": None,
    }
    assert parse_effort_budgets(" low : 10 , high:unlimited,medium:-1") == {
        "none": 0,
        "low": 10,
        "high": None,
        "medium": None,
    }
    for bad in ("low", "extreme:1", "low:-2", "low:ten", "none:5"):
        with pytest.raises(ValueError):
            parse_effort_budgets(bad)
    settings = Settings(reasoning_effort_budgets="minimal:8,low:64")
    assert effort_budget(settings, None, "") is None
    assert effort_budget(settings, "none", "{{ reasoning_effort }}") == 0  # off, even for gpt-oss's template
    assert effort_budget(settings, "minimal", "{{ messages }}") == 8
    assert effort_budget(settings, "low", "{{ messages }}") == 64
    assert effort_budget(settings, "high", "{{ messages }}") is None  # not listed: no bound
    assert effort_budget(settings, "low", "Reasoning: {{ reasoning_effort }}") is None  # the template reads it
    assert reads_effort({"default": "{{ reasoning_effort }}", "tool_use": ""}) and not reads_effort(None)


def test_anthropic_thinking_as_a_budget():
    from lmiserve.protocols.anthropic.parse import thinking_budget
    from lmiserve.protocols.anthropic.schema import MessagesRequest

    def budget(thinking):
        body = {"model": "m", "max_tokens": 2048, "messages": MESSAGES}
        return thinking_budget(MessagesRequest.model_validate({**body, "thinking": thinking} if thinking else body))

    assert budget({"type": "enabled", "budget_tokens": 1024}) == 1024
    assert budget({"type": "disabled"}) == 0
    assert budget({"type": "adaptive"}) is None and budget(None) is None


# --- over HTTP on the fake: what reaches the engine -------------------------------------------------------


@functools.cache
def thinking_tokenizer():
    return build_thinking_tokenizer()  # its template reads `reasoning_effort`


def no_effort_tokenizer():
    tokenizer = build_thinking_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.split("{% endif %}", 1)[1]  # without the effort line
    assert "reasoning_effort" not in tokenizer.chat_template
    return tokenizer


async def test_openai_effort_and_anthropic_thinking_reach_the_engine_as_budgets():
    served = text_app(
        tokenizer=no_effort_tokenizer(), reasoning_parser="qwen3", reasoning_effort_budgets="low:16,medium:none"
    )
    async with served.client() as http:
        for effort, expected in (("low", 16), ("medium", None), ("none", 0), (None, None)):
            served.fake.reply(Script(text="Paris."))
            body = {"messages": MESSAGES, **({"reasoning_effort": effort} if effort else {})}
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            thinking = served.fake.requests[-1].params.thinking
            assert (thinking and thinking.tokens) == expected, effort
            if expected is not None:
                assert thinking.close == "</think>" and thinking.inside == (effort != "none")
        # `none` turns thinking off in the template too: the block is closed in the prompt
        assert served.fake.requests[-2].prompt.endswith("<think>\n\n</think>\n\n")
        for thinking, expected in (({"type": "enabled", "budget_tokens": 100}, 100), ({"type": "adaptive"}, None)):
            served.fake.reply(Script(text="Paris."))
            body = {"model": "tiny", "max_tokens": 200, "messages": MESSAGES, "thinking": thinking}
            r = await http.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
            budget = served.fake.requests[-1].params.thinking
            assert (budget and budget.tokens) == expected


async def test_responses_reasoning_effort_reaches_the_engine_as_a_budget():
    served = text_app(tokenizer=no_effort_tokenizer(), reasoning_parser="qwen3", reasoning_effort_budgets="low:16")
    served.fake.reply(Script(text="Paris."))
    async with served.client() as http:
        body = {"input": "Capital of France?", "reasoning": {"effort": "low"}}
        assert (await http.post("/v1/responses", json=body)).status_code == 200
    assert served.fake.requests[-1].params.thinking.tokens == 16


async def test_a_template_that_reads_the_effort_gets_no_budget_but_none():
    served = text_app(tokenizer=thinking_tokenizer(), reasoning_parser="qwen3")
    async with served.client() as http:
        for effort, expected in (("low", None), ("none", 0)):
            served.fake.reply(Script(text="Paris."))
            body = {"messages": MESSAGES, "reasoning_effort": effort}
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            thinking = served.fake.requests[-1].params.thinking
            assert (thinking and thinking.tokens) == expected
            assert served.fake.requests[-1].prompt.startswith(f"<|system|>Reasoning effort: {effort}</s>")


async def test_without_a_reasoning_parser_nothing_is_bounded():
    plain = text_app(tokenizer=no_effort_tokenizer())
    plain.fake.reply(Script(text="Paris."))
    async with plain.client() as http:
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "reasoning_effort": "low"})
    assert r.status_code == 200 and plain.fake.requests[-1].params.thinking is None


async def test_the_forced_end_over_http_whole_and_streamed():
    """The fake engine runs the real `Sequence`: after the budget's tokens of the scripted thinking the
    end marker is forced, and what the script says after that is the answer."""
    tokenizer = no_effort_tokenizer()
    thought = tokenizer(" one two three four five six seven", add_special_tokens=False)["input_ids"][:5]
    thinking, answer = tokenizer.decode(thought[:3]), tokenizer.decode(thought[3:]).lstrip()
    served = text_app(tokenizer=tokenizer, reasoning_parser="qwen3", reasoning_effort_budgets="minimal:3")
    served.fake.reply(Script(ids=thought))
    anthropic = {"model": "tiny", "max_tokens": 60, "messages": MESSAGES}
    anthropic["thinking"] = {"type": "enabled", "budget_tokens": 3}
    async with served.client() as http:
        whole = (await http.post("/v1/messages", json=anthropic)).json()
        stream = await http.post("/v1/messages", json={**anthropic, "stream": True})
        chat = {"messages": MESSAGES, "reasoning_effort": "minimal", "max_tokens": 60}
        completion = (await http.post("/v1/chat/completions", json=chat)).json()
    assert whole["content"] == [
        {"type": "thinking", "thinking": thinking, "signature": ""},
        {"type": "text", "text": answer},
    ]
    assert '"thinking_delta"' in stream.text and '"text_delta"' in stream.text
    message = completion["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thinking, answer)
    assert completion["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}  # 3 and `</think>`
