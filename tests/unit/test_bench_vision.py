"""`lmiserve bench --scenario vision`: the requests (one deterministic image and a question each, as an
OpenAI `image_url` data URL, the token count forced), their closed loop against a mock chat server, the
report's vision section and chart, the CLI's defaults, and the in-process `generate()` baseline with
pixel inputs on tiny random VLMs (tests/helpers/tiny_vlm.py)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import httpx
import pytest
from matplotlib.image import imread
from PIL import Image

from helpers.tiny_vlm import load_tiny_vlm
from lmiserve import cli
from lmiserve.bench import clients as bench_clients
from lmiserve.bench.chart import draw_chart
from lmiserve.bench.chat import ChatDialect, run_chat_level
from lmiserve.bench.clients import BenchError
from lmiserve.bench.report import build_report, format_table
from lmiserve.bench.runner import all_requests_ok
from lmiserve.bench.stats import level_summary
from lmiserve.bench.vision import (
    IMAGE_SIZE,
    QUESTIONS,
    WARMUP_NUMBER,
    VisionRequest,
    draw_image,
    image_data_url,
    level_numbers,
    vision_messages,
)


def decode(url: str) -> Image.Image:
    head, _, data = url.partition(",")
    assert head == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data)))


# --- the requests --------------------------------------------------------------------------------------------


def test_a_request_is_one_png_image_and_a_question():
    (message,) = vision_messages(3)
    assert message["role"] == "user"
    image, text = message["content"]
    assert image["type"] == "image_url" and text == {"type": "text", "text": QUESTIONS[3]}
    png = decode(image["image_url"]["url"])
    assert png.format == "PNG" and png.size == IMAGE_SIZE == (640, 480) and png.mode == "RGB"
    assert list(png.getdata()) == list(draw_image(3).getdata())


def test_images_are_deterministic_and_distinct():
    assert image_data_url(5) == image_data_url(5)
    urls = {image_data_url(n) for n in range(16)}
    assert len(urls) == 16  # no two requests of a level share an image: the prefix cache cannot help
    assert decode(image_data_url(2, (64, 48))).size == (64, 48)


def test_a_vision_request_is_one_turn_and_sends_its_image():
    request = VisionRequest(7)
    assert request.turn == 1 and not request.awaiting_reply
    assert request.ask() == vision_messages(7)
    with pytest.raises(RuntimeError):
        request.ask()
    request.reply("an answer")
    payload = ChatDialect(url="http://x", name="x", model="m").payload(vision_messages(7), 16)
    assert payload["messages"] == vision_messages(7)
    assert payload["max_tokens"] == payload["min_tokens"] == 16 and payload["ignore_eos"] is True
    assert payload["stream"] is True and payload["temperature"] == 0


def test_level_numbers_are_those_the_closed_loop_sends():
    numbers = level_numbers(concurrency=3, requests_per_client=2, warmup=1)
    assert sorted(numbers) == [0, 1, 2, 3, 4, 5, WARMUP_NUMBER, WARMUP_NUMBER + 1, WARMUP_NUMBER + 2]


def _mock_chat_server(seen: list[dict]) -> httpx.MockTransport:
    """A streamed OpenAI chat route that forces `min_tokens` tokens and reports usage."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "vlm"}]})
        body = json.loads(request.content)
        seen.append(body)
        n = body["min_tokens"]
        events = [{"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]} for _ in range(n)]
        events.append({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": n}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_a_vision_level_sends_every_request_its_own_image(monkeypatch):
    seen: list[dict] = []
    transport = _mock_chat_server(seen)
    monkeypatch.setattr(
        bench_clients, "make_client", lambda c, t=600.0, key=None: httpx.AsyncClient(transport=transport)
    )
    dialect = ChatDialect(url="http://vlm", name="vlm")
    records, elapsed = asyncio.run(
        run_chat_level(dialect, 2, 5, turns=1, conversations_per_client=2, warmup=1, conversation=VisionRequest)
    )
    assert len(records) == len(seen) == 6 and all(r.error is None for r in records)
    urls = [body["messages"][0]["content"][0]["image_url"]["url"] for body in seen]
    assert len(set(urls)) == 6 and dialect.model == "vlm"
    assert {image_data_url(n) for n in level_numbers(2, 2, 1)} == set(urls)
    level = level_summary(2, records, elapsed)
    assert level["failed_requests"] == 0 and level["token_count_errors"] == 0
    assert [r.expected_tokens for r in records if not r.warmup] == [5] * 4


# --- the report ----------------------------------------------------------------------------------------------


def vision_level(c: int, tok_s: float, failed: int = 0) -> dict:
    ms = {"p50": 10.0 * c, "p99": 20.0 * c, "mean": 12.0, "max": 25.0, "count": 4}
    return {
        "concurrency": c,
        "requests": 3 * c,
        "failed_requests": failed,
        "token_count_errors": 0,
        "output_tokens_per_s": tok_s,
        "ttft_ms": ms,
        "itl_ms": ms,
        "itl_p99_over_p50": 2.0,
        "prompt_tokens_mean": 612.0,
    }


VISION_BASELINES = {
    "device": "cpu",
    "dtype": "float32",
    "threads": 4,
    "image_size": [640, 480],
    "generate": [
        {"batch_size": 1, "batched": True, "tokens": 16, "seconds": 1.0, "tokens_per_s": 16.0, "preprocess_s": 0.01}
        | {"prompt_tokens_mean": 600.0},
        {"batch_size": 8, "batched": False, "tokens": 128, "seconds": 2.0, "tokens_per_s": 64.0}
        | {"preprocess_s": 0.1, "prompt_tokens_mean": 600.0, "note": "one by one: the batch failed (X: y)"},
    ],
}


def vision_report(levels: list[dict]) -> dict:
    meta = {"model": {"name": "M"}, "settings": {"max_new_tokens": 16}, "device": "cpu", "dtype": "float32"}
    server = {"name": "lmiserve", "url": "http://a", "kind": "lmi", "levels": [], "vision_levels": levels}
    return build_report(meta, [server], None, None, None, (), VISION_BASELINES)


def test_the_report_compares_each_level_with_generate_on_the_same_images():
    report = vision_report([vision_level(1, 20.0), vision_level(8, 128.0)])
    ratios = report["servers"][0]["vision_ratios"]
    assert [(r["concurrency"], r["server_over_generate"], r["generate_batched"]) for r in ratios] == [
        (1, 1.25, True),
        (8, 2.0, False),
    ]
    assert report["vision_baselines"] == VISION_BASELINES
    assert {t["id"]: t for t in report["targets"]}["exact_tokens"]["passed"] is True
    assert all_requests_ok(report)
    text = format_table(report)
    assert "vision scenario (one 640x480 PNG a request over /v1/chat/completions):" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:2] == ["lmiserve", "8"]]
    assert rows[-1][-3:] == ["64.0", "2.00", "yes"]
    assert "batch 8: 64.0 tok/s (one by one: the batch failed (X: y)" in text


def test_a_failed_vision_request_fails_the_run():
    report = vision_report([vision_level(1, 20.0, failed=1)])
    assert {t["id"]: t for t in report["targets"]}["exact_tokens"]["value"] == 1
    assert not all_requests_ok(report)


def test_the_chart_shows_the_vision_levels_alone(tmp_path):
    report = vision_report([vision_level(1, 20.0), vision_level(8, 128.0)])
    image = imread(draw_chart(report, tmp_path / "bench.png"))
    assert image.shape[:2] == (520, 1600)


# --- the command ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "levels"), [([], [1, 8]), (["--concurrency", "2"], [2])])
def test_the_vision_scenario_runs_at_1_and_8_by_default(monkeypatch, tmp_path, capsys, argv, levels):
    from lmiserve.bench import runner

    configs = []

    def fake_run(config, log):
        configs.append(config)
        raise BenchError("stopped here")

    monkeypatch.setattr(runner, "run", fake_run)
    assert cli.main(["bench", "--scenario", "vision", "--output-dir", str(tmp_path), *argv]) == 1
    (config,) = configs
    assert config.scenarios == ["vision"] and config.concurrency == levels
    assert "stopped here" in capsys.readouterr().err


# --- the generate() baseline with pixel inputs ----------------------------------------------------------------


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def tiny_vlm(request, tiny_vlm_dir) -> object:
    import torch

    from lmiserve.engine.loaded import LoadedModel

    path = tiny_vlm_dir(request.param)
    model, processor = load_tiny_vlm(str(path))
    return LoadedModel(
        model=model,
        tokenizer=processor.tokenizer,
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_context=1024,
        eos_token_ids={processor.tokenizer.eos_token_id},
        name=request.param,
        path=Path(path),
        processor=processor,
    )


def test_the_baseline_batches_the_processor_output_left_padded(tiny_vlm):
    from lmiserve.bench.baselines_vision import chat_texts, processor_inputs

    processor = tiny_vlm.processor
    texts = chat_texts(processor, [0, 1, 2])
    assert [QUESTIONS[n] in t for n, t in enumerate(texts)] == [True] * 3
    inputs = processor_inputs(tiny_vlm, [0, 1, 2], (64, 48))
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.shape[0] == 3 and "pixel_values" in inputs
    lengths = mask.sum(dim=1).tolist()
    assert min(lengths) < max(lengths) and bool(mask[:, -1].all())  # left padding: every row ends at the end
    image_token = getattr(tiny_vlm.model.config, "image_token_id", None) or tiny_vlm.model.config.image_token_index
    assert all(int((row == image_token).sum()) > 0 for row in ids)  # each row holds its image's tokens


def test_the_baseline_generates_exactly_n_tokens_a_request(tiny_vlm):
    from lmiserve.bench.baselines_vision import generate_vision

    row = generate_vision(tiny_vlm, range(3), 4, (64, 48))
    assert row["batch_size"] == 3 and row["batched"] is True and row["tokens"] == 12
    assert row["tokens_per_s"] > 0 and row["prompt_tokens_mean"] > 0 and "note" not in row


def test_a_batch_the_model_refuses_runs_one_by_one_and_says_so(tiny_vlm, monkeypatch):
    from lmiserve.bench import baselines_vision

    real = baselines_vision._generate

    def refuse_batches(loaded, inputs, n):
        if inputs["input_ids"].shape[0] > 1:
            raise ValueError("no padded batches")
        return real(loaded, inputs, n)

    monkeypatch.setattr(baselines_vision, "_generate", refuse_batches)
    row = baselines_vision.generate_vision(tiny_vlm, range(2), 3, (64, 48))
    assert row["batched"] is False and row["tokens"] == 6
    assert row["note"] == "one by one: the batch failed (ValueError: no padded batches)"


def test_a_text_model_has_no_vision_baseline(tiny_vlm):
    from dataclasses import replace

    from lmiserve.bench.baselines_vision import processor_inputs

    text_only = replace(tiny_vlm, processor=None)
    with pytest.raises(RuntimeError, match="not a vision-language model"):
        processor_inputs(text_only, [0])


def test_the_baselines_load_the_model_as_the_server_does(tiny_vlm_dir):
    from lmiserve.bench.baselines_vision import run_vision_baselines

    path = tiny_vlm_dir("qwen2_vl")
    logged: list[str] = []
    result = run_vision_baselines({"model_id": str(path), "device": "cpu"}, [1, 2], 3, logged.append, (64, 48))
    assert result["image_size"] == [64, 48] and result["device"] == "cpu"
    assert [(r["batch_size"], r["tokens"], r["batched"]) for r in result["generate"]] == [(1, 3, True), (2, 6, True)]
    assert len(logged) == 2 and "generate (vision) batch   2" in logged[1]
