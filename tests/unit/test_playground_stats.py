"""The playground's pieces that need no server: the tokens/s figure, the stats of a model that is not
ready, the stream's pacing and end, and the URL printed at startup."""

from __future__ import annotations

import json

import pytest

from lmiserve.config import Settings
from lmiserve.core.stats import EngineSnapshot
from lmiserve.server.playground import url
from lmiserve.server.playground.stats import TokenRate, events, snapshot


def test_token_rate_averages_over_its_window():
    rate = TokenRate(window=2.0)
    assert rate.rate("m", 10.0, 100) == 0.0  # one sample: no rate yet
    assert rate.rate("m", 10.5, 150) == pytest.approx(100.0)
    assert rate.rate("m", 11.0, 150) == pytest.approx(50.0)  # 50 tokens over 1 s
    assert rate.rate("m", 13.0, 150) == pytest.approx(0.0)  # the burst left the window
    assert rate.rate("other", 13.0, 7) == 0.0  # per model


def test_token_rate_starts_over_when_the_count_goes_back():
    rate = TokenRate(window=2.0)
    rate.rate("m", 1.0, 500)
    assert rate.rate("m", 1.5, 10) == 0.0  # a reloaded model's new engine counts from 0
    assert rate.rate("m", 2.0, 30) == pytest.approx(40.0)


class FakeEngine:
    def __init__(self, snap: EngineSnapshot) -> None:
        self.snap = snap

    def snapshot(self) -> EngineSnapshot:
        return self.snap


class FakeService:
    def __init__(
        self,
        name: str,
        status: str = "READY",
        *,
        is_llm: bool = True,
        engine: FakeEngine | None = None,
        processor: object | None = None,
    ):
        self.name, self.status, self.is_llm, self.engine = name, status, is_llm, engine
        self.processor = processor  # a vision-language model's
        self.settings = Settings(max_image_bytes="5MiB", limit_mm_per_prompt=2)

    def ready_llm(self) -> FakeService:  # a LoadedModel's `processor`
        self.ready_generator()
        return self

    def ready_generator(self) -> FakeEngine:
        from lmiserve.core.errors import ModelNotReady

        if self.engine is None:
            raise ModelNotReady(f"Model {self.name} is loading")
        return self.engine


def test_snapshot_lists_llms_and_only_the_status_of_those_not_ready():
    snap = EngineSnapshot(
        running=3, waiting=1, batch_max_tokens=99, kv_tokens=50, kv_capacity=200, batch_slots=4, generated_tokens=10
    )
    models = [
        FakeService("llm", engine=FakeEngine(snap)),
        FakeService("loading", "PENDING"),
        FakeService("t", is_llm=False),
    ]
    out = snapshot(models, TokenRate(), now=5.0)  # type: ignore[arg-type]
    assert out == {
        "models": [
            {
                "name": "llm",
                "status": "ready",
                "running": 3,
                "waiting": 1,
                "batch_slots": 4,
                "kv_tokens": 50,
                "kv_capacity": 200,
                "kv_usage": 0.25,
                "kv_blocks": 0,
                "kv_block_size": 0,
                "preemptions": 0,
                "generated_tokens": 10,
                "prefix_cache_tokens": 0,
                "prefix_cache_capacity": 0,
                "tokens_per_second": 0.0,
                "vision": False,
            },
            {"name": "loading", "status": "pending"},
        ]
    }


def test_a_vision_language_model_says_it_takes_images_and_how_large():
    snap = EngineSnapshot(
        running=0, waiting=0, batch_max_tokens=9, kv_tokens=0, kv_capacity=10, batch_slots=1, generated_tokens=0
    )
    (entry,) = snapshot([FakeService("vlm", engine=FakeEngine(snap), processor=object())], TokenRate())["models"]  # type: ignore[list-item]
    assert entry["vision"] is True and entry["max_image_bytes"] == 5 * 2**20 and entry["max_images"] == 2


async def test_the_stream_sends_events_at_its_interval_and_ends_after_its_lifetime():
    chunks = [c async for c in events(lambda: [], TokenRate(), interval=0.01, lifetime=0.5)]
    assert 2 <= len(chunks) <= 1 + 50  # never faster than its interval; it ends
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
        assert json.loads(chunk[len(b"data: ") :]) == {"models": []}


@pytest.mark.parametrize(
    "host,expected",
    [
        ("0.0.0.0", "http://localhost:8080/playground"),
        ("::", "http://localhost:8080/playground"),
        ("127.0.0.1", "http://127.0.0.1:8080/playground"),
        ("::1", "http://[::1]:8080/playground"),
        ("example.internal", "http://example.internal:8080/playground"),
    ],
)
def test_the_startup_url(host, expected):
    assert url(Settings(host=host, port=8080)) == expected
