"""Regression tests for bugs where the server contradicted LMI's documented behaviour (docs/protocols/lmi.md) or lmiserve's own
documented decisions: dynamic-batch return_full_text default, explicit n=1 with best_of, and JSON
nested too deeply to parse (must be a 424, never a 500)."""

from __future__ import annotations

import json

PROMPTS = ["Hello world", "The quick brown fox", "Deep learning is"]


def test_dynamic_batch_generated_text_includes_the_prompt_by_default(dynamic_server, server):
    """lmiserve/protocols/lmi/formatters/dynamic_batch.py documents: "generated_text includes the prompt by default
    ... Pass return_full_text=False to get the completion only" (golden tests/golden/lmi/
    dynamic_batch_str.json agrees). Over HTTP the prompt is missing unless return_full_text=true:
    lmiserve/protocols/lmi/routes.py `dynamic_batch` passes `call.options.return_full_text`, which is
    LmiParameters.return_full_text (a bool defaulting to False), so "not given" becomes False."""
    completions = [server.generate(p, max_new_tokens=6)["generated_text"] for p in PROMPTS]
    response = dynamic_server.post({"inputs": PROMPTS, "parameters": {"max_new_tokens": 6}})
    assert response.status_code == 200, response.text
    assert [item["generated_text"] for item in json.loads(response.text)] == [
        p + c for p, c in zip(PROMPTS, completions)
    ]


def test_explicit_n_1_with_best_of_returns_a_single_sequence(server):
    """`best_of` *without* `n` -> n=best_of; with an explicit n the engine returns n
    sequences, and with a single returned sequence there is no `best_of_sequences` key.
    lmiserve/protocols/lmi/schema.py declares `n: int = Field(1, ...)`, so an explicit n=1 cannot be told from an
    absent n and `AsyncEngine._collect_ranked` returns all best_of sequences."""
    response = server.post(
        {
            "inputs": "Deep learning is",
            "parameters": {"max_new_tokens": 4, "do_sample": True, "seed": 3, "best_of": 3, "n": 1},
        }
    )
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    assert "best_of_sequences" not in details


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_deeply_nested_json_is_a_424_not_a_500(server):
    """A body nested ~1000+ levels deep makes `json.loads` raise RecursionError, which
    lmiserve/protocols/lmi/parse.py `decode_body` does not catch (it catches JSONDecodeError and
    UnicodeDecodeError only): the client gets starlette's 500 "Internal Server Error" as
    text/plain; charset=utf-8 instead of the 424 parse-failure body. Fix: also catch RecursionError (e.g.
    `except (ValueError, RecursionError)`) and report it through `_fail`."""
    bodies = [
        _deep(2000),
        b'{"inputs": "hi", "parameters": {"stop_sequences": ' + _deep(2000) + b"}}",
    ]
    for body in bodies:
        response = server.post(content=body, headers={"content-type": "application/json"})
        assert response.status_code == 424, (response.status_code, response.headers.get("content-type"), response.text)
        assert response.headers["content-type"] == "application/json"
        assert list(response.json()) == ["error", "code"]
    assert server.get("/ping").status_code == 200
