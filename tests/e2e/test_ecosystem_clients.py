"""The ecosystem's OpenAI clients, unmodified, against real `lmiserve serve` processes (issue #21's "Tests").

- `langchain-openai` (in .venv itself: `make install-langchain`): ChatOpenAI's `invoke`, `stream`,
  `stop=[...]`, `bind_tools` and `with_structured_output` on the bundled SmolLM2 (`make serve`'s server).
- `litellm` (in .venv-litellm: `make install-litellm`; its boto3 pin fights constraints.txt):
  `completion` through the `openai/` and `hosted_vllm/` providers and `text_completion`, plain, streamed
  and with `stop`, on the same server; tests/helpers/litellm_client.py runs in that venv.
- `lm-eval` (in .venv-lm-eval: `make install-lm-eval`): a local task made here (a YAML task and a JSONL
  dataset in a temporary directory, nothing downloaded) through `--model local-completions` on the tiny
  model, `generate_until` and multiple-choice `loglikelihood`, each checked against what the server or the
  model itself says.

`make test` installs every venv first; outside `make test` a missing venv skips its tests and says which
`make` target installs it (under make, MAKELEVEL is set, a missing venv fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import httpx
import pytest

from helpers.client_venvs import LANGCHAIN_STAMP, missing

pytestmark = pytest.mark.e2e  # the slowest tier: real servers, and two clients in venvs of their own

REPO = Path(__file__).resolve().parents[2]
LITELLM_PYTHON = REPO / ".venv-litellm" / "bin" / "python"
LITELLM_SCRIPT = REPO / "tests" / "helpers" / "litellm_client.py"
LM_EVAL = REPO / ".venv-lm-eval" / "bin" / "lm_eval"

QUESTION = "What is the capital of France?"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def smollm_url(server_pool, smollm_dir) -> str:  # smollm_dir converts the bundled GGUF into the user cache once
    return server_pool.url([], timeout=300)  # `make serve`'s server, shared with the other e2e modules


@pytest.fixture(scope="module")
def smollm_name(smollm_url) -> str:
    """The name the server lists at /v1/models (the `model` the clients send)."""
    models = httpx.get(f"{smollm_url}/v1/models", timeout=30).json()["data"]
    return models[0]["id"]


@pytest.fixture(scope="module")
def tiny_url(server_pool, tiny_model_dir) -> str:
    return server_pool.url(["--model-id", str(tiny_model_dir)])


# ---- langchain-openai ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(smollm_url, smollm_name):
    try:
        from langchain_openai import ChatOpenAI
    except ImportError:
        missing(LANGCHAIN_STAMP, "install-langchain")
        raise
    return ChatOpenAI(
        base_url=f"{smollm_url}/v1", api_key="none", model=smollm_name, temperature=0, max_tokens=24, max_retries=0
    )


def test_langchain_invoke_and_stream(chat_model):
    answer = chat_model.invoke(QUESTION)
    assert "paris" in answer.content.lower()
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.usage_metadata["output_tokens"] > 0
    chunks = list(chat_model.stream(QUESTION))
    assert "".join(chunk.content for chunk in chunks) == answer.content


def test_langchain_stop_is_excluded(chat_model):
    answer = chat_model.invoke(QUESTION).content
    assert "Paris" in answer, answer
    stopped = chat_model.invoke(QUESTION, stop=["Paris"])
    assert stopped.content == answer[: answer.index("Paris")]
    assert stopped.response_metadata["finish_reason"] == "stop"
    streamed = "".join(chunk.content for chunk in chat_model.stream(QUESTION, stop=["Paris"]))
    assert streamed == stopped.content


def test_langchain_bind_tools(chat_model):
    with_tools = chat_model.bind_tools([WEATHER_TOOL], tool_choice="required")
    message = with_tools.invoke("What is the weather like in Paris today?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert set(call["args"]) == {"location", "unit"} and call["args"]["unit"] in ("celsius", "fahrenheit")
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_with_structured_output(chat_model):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and the country it is the capital of."""

        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    structured = chat_model.with_structured_output(City, method="json_schema", strict=True)
    answer = structured.invoke("Name the capital of France as JSON.")
    assert isinstance(answer, City)
    raw = chat_model.with_structured_output(City, method="json_schema", include_raw=True).invoke(
        "Name the capital of France as JSON."
    )
    assert raw["parsing_error"] is None and raw["parsed"] == City.model_validate_json(raw["raw"].content)


# ---- litellm ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm(smollm_url, smollm_name) -> dict:
    """What litellm said for every check (tests/helpers/litellm_client.py, one process in .venv-litellm)."""
    missing(LITELLM_PYTHON, "install-litellm")
    done = subprocess.run(
        [str(LITELLM_PYTHON), str(LITELLM_SCRIPT), f"{smollm_url}/v1", smollm_name],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},  # never fetch the cost map at import
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_completion(litellm, provider):
    out = litellm[provider]
    assert "paris" in out["plain"].lower()
    assert out["plain_finish"] in ("stop", "length")
    assert out["streamed"] == out["plain"]
    assert "Paris" in out["plain"], out
    assert out["stopped"] == out["plain"][: out["plain"].index("Paris")]
    assert out["stopped_finish"] == "stop"
    assert out["stopped_streamed"] == out["stopped"]


def test_litellm_text_completion(litellm):
    out = litellm["text"]
    assert "paris" in out["plain"].lower()
    assert out["streamed"] == out["plain"]
    assert "Paris" in out["plain"], out
    assert out["stopped"] == out["plain"][: out["plain"].index("Paris")]
    assert out["stopped_finish"] == "stop"


# ---- lm-eval ----------------------------------------------------------------------------------------------

MC_ITEMS = [
    {"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "red"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"], "answer": 1},
    {"question": "Which animal says moo?", "choices": ["a cat", "a dog", "a cow"], "answer": 2},
    {"question": "What is two plus two?", "choices": ["four", "five", "three"], "answer": 0},
]
GEN_ITEMS = [
    {"prompt": "Once upon a time", "target": " there"},
    {"prompt": "The quick brown fox", "target": " jumps"},
]
MAX_GEN_TOKS = 12


def lm_eval(url: str, model_dir: Path, tmp_path: Path, task: str, yaml: str, items: list[dict], **args: str) -> list:
    """Run `lm_eval --model local-completions` on a task written here; the logged samples, in doc order."""
    missing(LM_EVAL, "install-lm-eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir(exist_ok=True)
    data = tasks / f"{task}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    header = f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tasks / f"{task}.yaml").write_text(header + textwrap.dedent(yaml), encoding="utf-8")
    model_args = {
        "model": model_dir.name,
        "base_url": f"{url}/v1/completions",
        "tokenizer": str(model_dir),
        "tokenizer_backend": "huggingface",
        "max_length": "256",
        "num_concurrent": "1",
        "max_retries": "1",
        **args,
    }
    out = tmp_path / "out"
    command = [
        str(LM_EVAL),
        "--model",
        "local-completions",
        "--model_args",
        ",".join(f"{k}={v}" for k, v in model_args.items()),
    ]
    command += ["--tasks", task, "--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    cache = tmp_path / "hf"
    env = {**os.environ, "HF_HOME": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=420, check=False, env=env, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    [samples] = out.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines() if line]
    return sorted(rows, key=lambda row: row["doc_id"])


def test_lm_eval_generate_until(tiny_url, tiny_model_dir, tmp_path):
    """`generate_until` through local-completions (string prompts): every answer is the server's own greedy
    completion of the prompt, cut before the task's stop string (OpenAI excludes it)."""
    greedy = []
    for item in GEN_ITEMS:
        body = {"model": "tiny", "prompt": item["prompt"], "max_tokens": MAX_GEN_TOKS, "temperature": 0}
        response = httpx.post(f"{tiny_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        greedy.append(response.json()["choices"][0]["text"])
    stop = greedy[0][len(greedy[0]) // 2]  # a character the first answer reaches halfway: the stop is exercised
    yaml = f"""\
        output_type: generate_until
        doc_to_text: "{{{{prompt}}}}"
        doc_to_target: "{{{{target}}}}"
        generation_kwargs:
          until: [{json.dumps(stop)}]
          max_gen_toks: {MAX_GEN_TOKS}
          do_sample: false
        metric_list:
          - metric: exact_match
        """
    rows = lm_eval(tiny_url, tiny_model_dir, tmp_path, "lmiserve_gen", yaml, GEN_ITEMS, tokenized_requests="False")
    assert [row["resps"][0][0] for row in rows] == [text.split(stop)[0] for text in greedy]


def reference_loglikelihoods(model_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """Each continuation's log-probability given its context, by transformers on the served weights, with
    lm-eval's tokenization (the whole text encoded once, no BOS; trailing spaces go to the continuation)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        ctxlen = len(tokenizer.encode(context, add_special_tokens=False))
        with torch.no_grad():
            logits = model(torch.tensor([whole])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append(sum(logprobs[i - 1, whole[i]].item() for i in range(ctxlen, len(whole))))
    return out


def test_lm_eval_loglikelihood_multiple_choice(tiny_url, tiny_model_dir, tmp_path):
    """Multiple choice (`loglikelihood`) through local-completions with lm-eval's default token-id prompts:
    each choice's score equals the model's own log-probability of it, and `acc` follows from them."""
    yaml = """\
        output_type: multiple_choice
        doc_to_text: "Question: {{question}}\\nAnswer:"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list:
          - metric: acc
        """
    rows = lm_eval(tiny_url, tiny_model_dir, tmp_path, "lmiserve_mc", yaml, MC_ITEMS, tokenized_requests="True")
    pairs = [
        (f"Question: {item['question']}\nAnswer:", f" {choice}") for item in MC_ITEMS for choice in item["choices"]
    ]
    reference = iter(reference_loglikelihoods(tiny_model_dir, pairs))
    for item, row in zip(MC_ITEMS, rows, strict=True):
        expected = [next(reference) for _ in item["choices"]]
        scores = [float(resp[0][0]) for resp in row["resps"]]  # logged as strings
        assert scores == pytest.approx(expected, abs=2e-3), (scores, expected)
        best = max(range(len(expected)), key=expected.__getitem__)
        assert row["acc"] == float(best == item["answer"])
