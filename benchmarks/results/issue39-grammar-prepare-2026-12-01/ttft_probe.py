"""The time to first token of a plain and of a JSON-schema request on one port, sent in turns one at a time
by a light client while a bench loads the server; prints each kind's count, p50 and p90 (ms) as JSON.

    python ttft_probe.py PORT SECONDS
"""

import http.client
import json
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
KINDS = {
    "plain": {"inputs": "Invent a person.", "parameters": {"max_new_tokens": 4}},
    "grammar": {
        "inputs": "Invent a person.",
        "parameters": {"max_new_tokens": 4, "grammar": {"type": "json", "value": SCHEMA}},
    },
}


def ttft(port: int, body: dict) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port)
    start = time.perf_counter()
    connection.request("POST", "/generate_stream", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    response.readline()  # the first event
    first = time.perf_counter() - start
    response.read()
    connection.close()
    return first * 1000


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    end = time.time() + seconds
    while time.time() < end:
        for kind, body in KINDS.items():
            times[kind].append(ttft(port, body))
    summary = {
        kind: {"n": len(v), "p50": round(statistics.median(v), 1), "p90": round(sorted(v)[int(len(v) * 0.9)], 1)}
        for kind, v in times.items()
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
