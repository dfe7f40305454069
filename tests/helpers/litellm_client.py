"""litellm, unmodified, run with .venv-litellm's python (litellm pins boto3, whose python-dateutil fights
lmiserve's constraints.txt).

    python litellm_client.py http://127.0.0.1:PORT/v1 MODEL   -> JSON on the last line

One process (importing litellm takes seconds) for every check: `litellm.completion` through the `openai/`
and the `hosted_vllm/` provider, greedy, plain and streamed, then with ``stop=["Paris"]`` plain and
streamed; `litellm.text_completion` (`openai/`) on a prompt, plain, streamed and stopped. Printed: the
texts and finish reasons, by check.
"""

from __future__ import annotations

import json
import sys

import litellm

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Question: What is the capital of France?\nAnswer: The capital of France is"


def chat(base: str, model: str) -> dict:
    common = {"model": model, "api_base": base, "api_key": "none", "temperature": 0, "max_tokens": 24}
    plain = litellm.completion(messages=QUESTION, **common)
    streamed = litellm.completion(messages=QUESTION, stream=True, **common)
    stopped = litellm.completion(messages=QUESTION, stop=["Paris"], **common)
    stopped_streamed = litellm.completion(messages=QUESTION, stop=["Paris"], stream=True, **common)
    return {
        "plain": plain.choices[0].message.content,
        "plain_finish": plain.choices[0].finish_reason,
        "streamed": "".join(chunk.choices[0].delta.content or "" for chunk in streamed),
        "stopped": stopped.choices[0].message.content,
        "stopped_finish": stopped.choices[0].finish_reason,
        "stopped_streamed": "".join(chunk.choices[0].delta.content or "" for chunk in stopped_streamed),
    }


def text(base: str, model: str) -> dict:
    common = {"model": model, "api_base": base, "api_key": "none", "temperature": 0, "max_tokens": 8}
    plain = litellm.text_completion(prompt=PROMPT, **common)
    streamed = litellm.text_completion(prompt=PROMPT, stream=True, **common)
    stopped = litellm.text_completion(prompt=PROMPT, stop=["Paris"], **common)
    return {
        "plain": plain.choices[0].text,
        "plain_finish": plain.choices[0].finish_reason,
        "streamed": "".join(chunk.choices[0].text or "" for chunk in streamed),
        "stopped": stopped.choices[0].text,
        "stopped_finish": stopped.choices[0].finish_reason,
    }


if __name__ == "__main__":
    base_url, model_name = sys.argv[1:3]
    results = {
        "openai": chat(base_url, f"openai/{model_name}"),
        "hosted_vllm": chat(base_url, f"hosted_vllm/{model_name}"),
        "text": text(base_url, f"openai/{model_name}"),
    }
    print(json.dumps(results))
