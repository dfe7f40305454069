"""Bad requests to a real server process: each answers LMI's 424 ``{"error": ..., "code": 424}`` (never
a 500, never a hang), and the process keeps answering normally afterwards.

The exact message of every bad payload, parameter and prompt is checked in process, over the same app,
in tests/unit/test_lmi_text_http.py; this module checks what only a real process can show: that
uvicorn's HTTP layer and the real engine come through a burst of them unharmed.
"""

from __future__ import annotations

import json

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # well over the server's 64 tokens
BAD_BODIES: list[tuple[bytes, dict[str, str]]] = [
    (b'{"inputs": ', {"content-type": "application/json"}),  # truncated JSON
    (b"not json at all", {"content-type": "application/json"}),
    (b"", {}),
    (json.dumps({"input": "x" * 200_000}).encode(), {"content-type": "application/json"}),
    (json.dumps({"inputs": ["a", "b"], "stream": True}).encode(), {"content-type": "application/json"}),
    (json.dumps({"inputs": "hi", "parameters": [1]}).encode(), {"content-type": "application/json"}),
    (json.dumps({"inputs": "hi", "parameters": {"temperature": -1}}).encode(), {"content-type": "application/json"}),
    (
        json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 10**9}}).encode(),
        {"content-type": "application/json"},
    ),
    (
        json.dumps({"inputs": "hi", "parameters": {"n": 2}, "stream": True}).encode(),
        {"content-type": "application/json"},
    ),
    (json.dumps({"inputs": LONG_PROMPT}).encode(), {"content-type": "application/json"}),
    (json.dumps({"inputs": LONG_PROMPT, "stream": True}).encode(), {"content-type": "application/json"}),
]


def test_server_still_healthy_after_bad_requests(server):
    for content, headers in BAD_BODIES:
        response = server.post(content=content, headers=headers)
        assert response.status_code == 424, (content[:80], response.status_code, response.text[:300])
        assert response.headers["content-type"] == "application/json"
        body = json.loads(response.text)
        assert list(body) == ["error", "code"] and body["code"] == 424 and body["error"]
        assert len(response.text) < 1000  # a large payload is quoted in a short excerpt only
    assert server.get("/ping").status_code == 200
    response = server.post({"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": True}})
    assert response.status_code == 200, response.text
    assert response.json()["details"]["generated_tokens"] <= 4
    _, lines = server.stream("Hello", max_new_tokens=3)
    assert 1 <= len(lines) <= 3
