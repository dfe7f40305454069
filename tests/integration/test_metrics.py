"""GET /metrics on real servers: TGI's and vLLM's metrics and the per-protocol request metrics move by
exactly what was sent, gauges show the running batch while streams are open and return to 0, and the
route needs the API key on the serving port but not on `metrics_port`.

Every check compares two scrapes (after - before), so the requests of other tests on a shared server
never matter. The exposition is parsed with prometheus_client's own parser; that parser names a
counter's samples ``..._total`` whatever the wire says, so the wire spelling of TGI's counters is
checked on the raw text.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.server import free_port, run_server
from helpers.tiny_model import ENDLESS_CONTEXT
from helpers.waiting import HANG_TIMEOUT, wait_until
from lmiserve.server.metrics.tgi import TGI_DURATION_BUCKETS
from lmiserve.server.metrics.vllm import VLLM_TTFT_BUCKETS

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
VLLM_REASON = {"length": "length", "eos_token": "stop", "stop_sequence": "stop", "stop": "stop"}


@dataclass
class Scrape:
    text: str
    samples: list[tuple[str, dict[str, str], float]]

    @classmethod
    def of(cls, response: httpx.Response) -> Scrape:
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        samples = [
            (s.name, s.labels, s.value)
            for family in text_string_to_metric_families(response.text)
            for s in family.samples
        ]
        return cls(response.text, samples)

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples named `name` whose labels include `labels` (0 when there is none)."""
        return sum(v for n, ls, v in self.samples if n == name and labels.items() <= ls.items())

    def buckets(self, name: str) -> list[float]:
        return sorted({float(ls["le"]) for n, ls, _ in self.samples if n == name + "_bucket"})


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.total(name, **labels) - before.total(name, **labels)


@dataclass
class Metered:
    url: str
    metrics_url: str
    client: httpx.Client  # sends the API key
    name: str

    def scrape(self) -> Scrape:
        return Scrape.of(self.client.get("/metrics"))


@pytest.fixture(scope="module")
def metered(tiny_model_dir) -> Iterator[Metered]:
    """The tiny model behind an API key, with /metrics also on a port of its own."""
    port = free_port()
    args = ["--model-id", str(tiny_model_dir), "--api-key", KEY, "--metrics-port", str(port), "-o", "max_input_len=64"]
    with (
        run_server(args) as url,
        httpx.Client(base_url=url, headers=AUTH, timeout=HANG_TIMEOUT, trust_env=False) as client,
    ):
        yield Metered(url, f"http://127.0.0.1:{port}", client, tiny_model_dir.name)


@dataclass
class Done:
    prompt_tokens: int
    generated_tokens: int
    reason: str  # vLLM's finished_reason


def test_counters_and_histograms_move_by_exactly_the_requests_sent(metered):
    client, name = metered.client, metered.name
    before = metered.scrape()
    done: list[Done] = []
    for prompt, tokens in (("Hello world", 4), ("The quick brown fox", 7)):
        parameters = {"max_new_tokens": tokens, "details": True, "decoder_input_details": True}
        r = client.post("/generate", json={"inputs": prompt, "parameters": parameters})
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        done.append(Done(len(details["prefill"]), details["generated_tokens"], VLLM_REASON[details["finish_reason"]]))
    for path, payload in (
        ("/v1/completions", {"model": name, "prompt": "Once upon a time", "max_tokens": 5}),
        ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        ("/invocations", {"messages": [{"role": "user", "content": "Hey there"}], "max_tokens": 6}),  # OpenAI body
    ):
        r = client.post(path, json=payload)
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        done.append(Done(usage["prompt_tokens"], usage["completion_tokens"], body["choices"][0]["finish_reason"]))
    # refused by the engine (LMI checks the prompt length there): counted by TGI's metrics as validation
    too_long = client.post("/invocations", json={"inputs": "hello " * 100, "parameters": {"max_new_tokens": 2}})
    assert too_long.status_code == 424, too_long.text
    # refused by TGI's validation before the engine: a 422 of the tgi protocol, no generation
    invalid = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 0}})
    assert invalid.status_code == 422, invalid.text
    after = metered.scrape()

    def moved(metric: str, **labels: str) -> float:
        return delta(before, after, metric, **labels)

    ok, prompt, generated = len(done), sum(d.prompt_tokens for d in done), sum(d.generated_tokens for d in done)
    assert ok == 5 and all(d.generated_tokens >= 1 for d in done)
    # TGI
    assert moved("tgi_request_count_total") == ok + 1
    assert moved("tgi_request_success_total") == ok
    assert moved("tgi_request_failure_total") == 1
    assert moved("tgi_request_failure_total", err="validation") == 1
    for histogram in (
        "tgi_request_duration",
        "tgi_request_queue_duration",
        "tgi_request_inference_duration",
        "tgi_request_mean_time_per_token_duration",
        "tgi_request_generated_tokens",
    ):
        assert moved(histogram + "_count") == ok, histogram
        assert moved(histogram + "_bucket", le="+Inf") == ok, histogram
    assert moved("tgi_request_generated_tokens_sum") == generated
    assert moved("tgi_request_input_length_count") == ok  # accepted by the engine
    assert moved("tgi_request_input_length_sum") == prompt
    for method in ("prefill", "decode"):
        steps = moved("tgi_batch_forward_duration_count", method=method)
        assert steps >= 1 and moved("tgi_batch_inference_count_total", method=method) == steps
    # vLLM
    labels = {"model_name": name, "engine": "0"}
    assert moved("vllm:prompt_tokens_total", **labels) == prompt
    assert moved("vllm:generation_tokens_total", **labels) == generated
    for reason in ("stop", "length", "abort", "error"):
        expected = sum(1 for d in done if d.reason == reason)
        assert moved("vllm:request_success_total", finished_reason=reason, **labels) == expected, reason
    for histogram in (
        "vllm:e2e_request_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
    ):
        assert moved(histogram + "_count", **labels) == ok, histogram
    for histogram in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert moved(histogram + "_count", **labels) == generated - ok, histogram
    # per protocol and model
    requests = "lmiserve_requests_total"
    assert moved(requests, protocol="tgi", model=name, status="200") == 2
    assert moved(requests, protocol="tgi", status="422") == 1
    assert moved(requests, protocol="openai", model=name, status="200") == 3
    assert moved(requests, protocol="lmi", model=name, status="424") == 1
    assert moved("lmiserve_request_duration_seconds_count", protocol="tgi") == 3
    assert moved("lmiserve_request_duration_seconds_count", protocol="openai", model=name) == 3


def test_prefix_cache_queries_and_hits_count_prompt_tokens(metered):
    client, name = metered.client, metered.name
    prompt = "Continuous batching lets new requests join a running batch between steps. Numbers like 1, 2"
    before = metered.scrape()
    usages = []
    for _ in range(2):
        r = client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    after = metered.scrape()
    labels = {"model_name": name, "engine": "0"}
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached >= 16
    assert delta(before, after, "vllm:prefix_cache_queries_total", **labels) == prompt_tokens
    assert delta(before, after, "vllm:prefix_cache_hits_total", **labels) == cached
    assert delta(before, after, "vllm:prompt_tokens_total", **labels) == prompt_tokens  # cached ones included
    assert 0 < after.total("lmiserve_prefix_cache_usage_perc", **labels) <= 1


def test_tensor_routes_are_counted_per_protocol_and_model(metered):
    client, name = metered.client, metered.name
    before = metered.scrape()
    r = client.post(f"/v2/models/{name}/generate", json={"text_input": "Hi", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200, r.text
    assert client.get(f"/v2/models/{name}").status_code == 200
    assert client.get("/v2/models/not-served").status_code == 404
    assert client.get("/v1/models/not-served").status_code == 404  # TF Serving
    after = metered.scrape()
    requests = "lmiserve_requests_total"
    assert delta(before, after, requests, protocol="kserve", model=name, status="200") == 2
    assert delta(before, after, requests, protocol="kserve", model="", status="404") == 1
    assert delta(before, after, requests, protocol="tfserving", model="", status="404") == 1
    assert delta(before, after, "lmiserve_request_duration_seconds_count", protocol="kserve", model=name) == 2
    # the generation is one engine request, counted once whatever protocol carried it
    assert delta(before, after, "tgi_request_count_total") == 1
    assert delta(before, after, "tgi_request_success_total") == 1
    assert delta(before, after, "vllm:request_success_total", model_name=name) == 1


def test_the_exposition_uses_tgis_and_vllms_spellings_and_buckets(metered):
    client = metered.client
    assert client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    assert client.post("/invocations", json={"inputs": "hello " * 100}).status_code == 424
    scrape = metered.scrape()
    text = scrape.text
    for counter in ("tgi_request_count", "tgi_request_success"):  # TGI's exporter adds no _total
        assert f"# TYPE {counter} counter\n" in text and f"\n{counter} " in text
    assert "# TYPE tgi_request_failure counter\n" in text and '\ntgi_request_failure{err="validation"} ' in text
    assert '\ntgi_batch_inference_count{method="prefill"} ' in text
    for gauge in ("tgi_batch_current_size", "tgi_batch_current_max_tokens", "tgi_queue_size"):
        assert f"# TYPE {gauge} gauge\n" in text
    for histogram in ("tgi_request_duration", "tgi_batch_forward_duration", "tgi_request_input_length"):
        assert f"# TYPE {histogram} histogram\n" in text
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {gauge} gauge\n" in text
    for counter in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"):
        assert f"# TYPE {counter} counter\n" in text
    assert "# TYPE vllm:num_preemptions_total counter\n" in text  # read from the engine at scrape time
    labels = {"model_name": metered.name, "engine": "0"}
    assert ("vllm:num_preemptions_total", labels, 0.0) in scrape.samples  # no preemption on a roomy pool
    # the engine's steps (on the CPU serially: none planned ahead; async_scheduling is off there by default)
    steps = [value for name, got, value in scrape.samples if name == "lmiserve_engine_steps_total" and got == labels]
    assert steps and steps[0] >= 2  # the prompt's step and the second token's
    assert ("lmiserve_engine_steps_planned_ahead_total", labels, 0.0) in scrape.samples
    assert scrape.buckets("tgi_request_duration") == [*TGI_DURATION_BUCKETS, float("inf")]
    assert scrape.buckets("vllm:time_to_first_token_seconds") == [*VLLM_TTFT_BUCKETS, float("inf")]


def test_metrics_needs_the_key_on_the_serving_port_and_not_on_the_metrics_port(metered):
    with httpx.Client(base_url=metered.url, timeout=HANG_TIMEOUT, trust_env=False) as anonymous:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = anonymous.get("/metrics", headers=headers)
            assert (r.status_code, r.text) == (401, "missing or wrong API key")
    with httpx.Client(base_url=metered.metrics_url, timeout=HANG_TIMEOUT, trust_env=False) as scraper:
        apart = Scrape.of(scraper.get("/metrics"))
        assert scraper.get("/invocations").status_code == 404  # that port serves /metrics only
        assert scraper.get("/ping").status_code == 404
    served = metered.scrape()
    assert {n for n, _, _ in apart.samples} == {n for n, _, _ in served.samples}


# ---- gauges: the running batch of `small_server` (one slot, one queue place, endless context) --------

LONG = ENDLESS_CONTEXT - 64
PROMPT = "Hello world"


def test_gauges_show_the_running_batch_and_return_to_zero(small_server):
    name = small_server.name

    def scrape() -> Scrape:
        return Scrape.of(small_server.get("/metrics"))

    def gauges(s: Scrape) -> tuple[float, ...]:
        labels = {"model_name": name, "engine": "0"}
        return (
            s.total("vllm:num_requests_running", **labels),
            s.total("vllm:num_requests_waiting", **labels),
            s.total("tgi_batch_current_size"),
            s.total("tgi_queue_size"),
        )

    wait_until(lambda: gauges(scrape()) == (0, 0, 0, 0), "the server is idle")
    before = scrape()
    assert before.total("vllm:kv_cache_usage_perc", model_name=name) == 0
    assert before.total("tgi_batch_current_max_tokens") == 0
    short = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "ignore_eos_token": True, "details": True}}
    long = {"inputs": PROMPT, "parameters": {"max_new_tokens": LONG, "ignore_eos_token": True}}
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        with small_server.new_client() as client, client.stream("POST", "/generate_stream", json=long) as stream:
            assert stream.status_code == 200
            events = stream.iter_bytes()
            next(events)  # the long request holds the only slot
            running = scrape()
            assert gauges(running) == (1, 0, 1, 0)
            assert 0 < running.total("vllm:kv_cache_usage_perc", model_name=name) < 1
            prompt_tokens = small_server.post({"inputs": PROMPT}, path="/tokenize").json()
            assert running.total("tgi_batch_current_max_tokens") == len(prompt_tokens) + LONG
            queued = pool.submit(small_server.post, short, path="/generate", timeout=HANG_TIMEOUT)
            wait_until(lambda: gauges(scrape()) == (1, 1, 1, 1), "the second request waits for the slot")
            next(events)
        # the long stream's client went away: the queued request runs, then the server is idle again
        answer = queued.result(timeout=HANG_TIMEOUT)
        assert answer.status_code == 200, answer.text
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    wait_until(lambda: gauges(scrape()) == (0, 0, 0, 0), "the batch and the queue are empty")
    after = scrape()
    assert after.total("vllm:kv_cache_usage_perc", model_name=name) == 0
    assert after.total("tgi_batch_current_max_tokens") == 0
    assert delta(before, after, "tgi_request_count_total") == 2
    assert delta(before, after, "tgi_request_success_total") == 1
    assert delta(before, after, "tgi_request_failure_total", err="dropped") == 1
    assert delta(before, after, "vllm:request_success_total", model_name=name, finished_reason="abort") == 1
    assert delta(before, after, "vllm:request_success_total", model_name=name, finished_reason="length") == 1
    assert delta(before, after, "vllm:request_queue_time_seconds_count", model_name=name) == 2
    assert delta(before, after, "tgi_request_queue_duration_count") == 1  # successes only, as TGI


def test_event_loop_lag_is_observed_while_the_server_runs(metered):
    """The lifespan's watcher observes a wake-up every 0.1 s (its lag bounded here loosely: the test
    machine is shared)."""
    name = "lmiserve_event_loop_lag_seconds"
    before = metered.scrape().total(name + "_count")
    wait_until(lambda: metered.scrape().total(name + "_count") >= before + 3, "three more wake-ups are observed")
    scrape = metered.scrape()
    assert scrape.buckets(name)[0] == 0.001
    assert 0 <= scrape.total(name + "_sum") / scrape.total(name + "_count") < 1.0
