"""`lmiserve bench --scenario chat`: the conversations it sends, how a chat stream's chunks count,
the per-turn figures, the peer and A/B comparisons and their targets (synthetic figures, no server)."""

from __future__ import annotations

import pytest

from lmiserve.bench import baselines
from lmiserve.bench.chat import ChatDialect, read_chunk
from lmiserve.bench.chat_report import (
    ab_comparison,
    forward_targets,
    peer_comparisons,
    peer_targets,
    prefix_cache_target,
)
from lmiserve.bench.config import BenchConfig
from lmiserve.bench.conversations import (
    FOLLOW_UPS,
    SYSTEM_PROMPT,
    Conversation,
    chat_level_summary,
    conversation_number,
    late_ttft_ratios,
    turn_summaries,
    user_message,
)
from lmiserve.bench.prompts import prompt_for
from lmiserve.bench.report import build_report, format_table
from lmiserve.bench.stats import RequestRecord

# --- conversations ---------------------------------------------------------------------------------


def test_first_messages_are_unique_and_later_turns_are_follow_ups():
    firsts = [user_message(k, 1) for k in range(40)]
    assert len(set(firsts)) == 40  # no two conversations share more than the system prompt
    assert firsts[3] == f"(Conversation 3.) {prompt_for(3)}"
    assert all(user_message(k, t) in FOLLOW_UPS for k in range(5) for t in range(2, 9))
    assert user_message(0, 2) != user_message(0, 3)
    with pytest.raises(ValueError, match="turns start at 1"):
        user_message(0, 0)


def test_every_turn_resends_the_whole_history():
    conv = Conversation(7)
    assert conv.turn == 1 and not conv.awaiting_reply
    first = conv.ask()
    assert first == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_message(7, 1)}]
    assert conv.turn == 1 and conv.awaiting_reply
    with pytest.raises(RuntimeError, match="no reply yet"):
        conv.ask()
    conv.reply("Reply one.")
    assert conv.turn == 2
    second = conv.ask()
    assert second[: len(first)] == first  # the previous request is a prefix of the next one
    assert second[2:] == [
        {"role": "assistant", "content": "Reply one."},
        {"role": "user", "content": user_message(7, 2)},
    ]
    second[0]["content"] = "changed"  # the caller gets a copy
    assert conv.messages[0]["content"] == SYSTEM_PROMPT
    conv.reply("")
    with pytest.raises(RuntimeError, match="no user message"):
        conv.reply("again")
    assert conv.turn == 3 and len(conv.ask()) == 6


def test_conversation_numbers_do_not_collide_across_clients():
    numbers = [conversation_number(c, i, 4) for c in range(4) for i in range(3)]
    assert sorted(numbers) == list(range(12))


# --- chat stream chunks ----------------------------------------------------------------------------


def record(**kw):
    return RequestRecord(client=0, index=0, warmup=False, expected_tokens=3, start=0.0, **kw)


def test_chunks_count_content_tokens_only():
    r = record()
    read_chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}, 0.1, r)
    read_chunk({"choices": [{"delta": {"role": "assistant", "content": None}}]}, 0.15, r)  # llama.cpp's first
    read_chunk({"choices": [{"delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]}, 0.2, r)
    read_chunk({"choices": [{"delta": {"content": ""}, "finish_reason": None}]}, 0.3, r)  # a partial character
    read_chunk({"choices": [{"delta": {"content": "lo"}, "finish_reason": "length"}]}, 0.4, r)
    read_chunk({"choices": [{"delta": {}, "finish_reason": "length"}]}, 0.5, r)
    read_chunk({"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]}, 0.55, r)
    assert r.token_times == [0.2, 0.3, 0.4] and "".join(r.text) == "Hello"
    assert r.tokens == 3 and r.count_ok and r.ttft == pytest.approx(0.2)
    assert r.prompt_tokens is None and r.cached_tokens is None
    usage = {"prompt_tokens": 120, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 96}}
    read_chunk({"choices": [], "usage": usage}, 0.6, r)
    assert (r.usage_tokens, r.prompt_tokens, r.cached_tokens) == (3, 120, 96)


def test_chat_payload_forces_the_token_count():
    body = ChatDialect(url="http://x", name="x", model="m").payload([{"role": "user", "content": "hi"}], 16)
    assert body["max_tokens"] == body["min_tokens"] == 16 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and body["messages"] == [{"role": "user", "content": "hi"}]


# --- per-turn figures ------------------------------------------------------------------------------


def chat_record(client, index, turn, ttft, tokens=3, warmup=False, gap=0.01, prompt=None, cached=None):
    start = 10.0 * client + index
    times = [start + ttft + i * gap for i in range(tokens)]
    return RequestRecord(
        client=client,
        index=index,
        warmup=warmup,
        expected_tokens=3,
        start=start,
        token_times=times,
        end=times[-1] + 0.001,
        turn=turn,
        conversation=client,
        prompt_tokens=prompt,
        cached_tokens=cached,
    )


def test_turn_summaries_and_the_late_turn_ratio():
    records = [chat_record(0, 0, 1, 5.0, warmup=True)]  # warm-up: not in the per-turn figures
    for client in (0, 1):
        for turn, ttft in ((1, 0.4), (2, 0.2), (3, 0.1), (4, 0.1 + 0.1 * client)):
            records.append(chat_record(client, turn, turn, ttft, prompt=100 * turn, cached=90 * (turn - 1)))
    records.append(chat_record(1, 5, 1, 0.4))
    records[-1].error = "HTTP 500: boom"  # failed: counted as failed, not in the turn figures
    turns = turn_summaries(records)
    assert [t["turn"] for t in turns] == [1, 2, 3, 4]
    assert [t["requests"] for t in turns] == [2, 2, 2, 2]
    assert [t["ttft_ms"]["p50"] for t in turns] == [400.0, 200.0, 100.0, 150.0]
    assert turns[0]["itl_ms"]["p50"] == pytest.approx(10.0) and turns[0]["itl_ms"]["count"] == 4
    assert turns[0]["request_tokens_per_s"] == pytest.approx(100.0)  # 2 gaps of 10 ms
    assert turns[2]["prompt_tokens_mean"] == 300.0 and turns[2]["cached_tokens_mean"] == 180.0
    assert turns[0]["tokens_received"] == 6
    level = chat_level_summary(2, records, 20.0)
    assert level["turns"] == turns and level["conversations"] == 2
    assert level["ttft_p50_turn1_ms"] == 400.0
    assert level["ttft_p50_late_turns_ms"] == 100.0  # turns 3 and 4: 100, 100, 100, 200
    assert level["late_over_turn1"] == 0.25
    assert level["failed_requests"] == 1 and level["requests"] == 10


def chat_level(c, tok_s, late_ms, turn1_ms=400.0):
    return {
        "concurrency": c,
        "output_tokens_per_s": tok_s,
        "failed_requests": 0,
        "token_count_errors": 0,
        "ttft_p50_turn1_ms": turn1_ms,
        "ttft_p50_late_turns_ms": late_ms,
        "turns": [
            {
                "turn": 1,
                "requests": c,
                "ttft_ms": {"p50": turn1_ms, "p99": turn1_ms},
                "itl_ms": {"p50": 30.0, "p99": 40.0},
                "request_tokens_per_s": 30.0,
                "prompt_tokens_mean": 150.0,
                "cached_tokens_mean": None,
            }
        ],
    }


def test_late_ttft_ratios_per_concurrency():
    rows = late_ttft_ratios([chat_level(1, 30.0, 50.0), chat_level(8, 90.0, 80.0)], [chat_level(1, 30.0, 400.0)])
    assert rows == [
        {"concurrency": 1, "a_ms": 50.0, "b_ms": 400.0, "a_over_b": 0.125},
        {"concurrency": 8, "a_ms": 80.0, "b_ms": None, "a_over_b": None},
    ]


# --- peers, A/B and the targets in the report ------------------------------------------------------


def completion_level(c, tok_s):
    return {
        "concurrency": c,
        "requests": 3 * c,
        "measured_requests": 2 * c,
        "failed_requests": 0,
        "errors": [],
        "token_count_errors": 0,
        "token_count_examples": [],
        "tokens_expected": 3,
        "tokens_received": 3,
        "output_tokens_per_s": tok_s,
        "ttft_ms": {"p50": 100.0, "p99": 150.0},
        "itl_ms": {"p50": 30.0, "p99": 40.0},
        "itl_p99_over_p50": 1.333,
    }


def server(name, kind, levels, chat_levels, **extra):
    return {"name": name, "url": "http://x", "kind": kind, "levels": levels, "chat_levels": chat_levels, **extra}


def test_peer_comparisons_and_targets():
    main = server("lmiserve", "lmi", [completion_level(1, 30.0), completion_level(8, 120.0)], [chat_level(1, 25, 1)])
    peer = server("llama.cpp", "openai", [completion_level(1, 40.0), completion_level(8, 50.0)], [chat_level(1, 50, 1)])
    comparisons = peer_comparisons(main, [peer])
    assert [(c["peer"], c["scenario"]) for c in comparisons] == [("llama.cpp", "completion"), ("llama.cpp", "chat")]
    assert [r["lmiserve_over_peer"] for r in comparisons[0]["rows"]] == [0.75, 2.4]
    assert comparisons[1]["rows"] == [
        {"concurrency": 1, "lmiserve_tokens_per_s": 25, "peer_tokens_per_s": 50, "lmiserve_over_peer": 0.5}
    ]
    targets = {t["id"]: t for t in peer_targets(comparisons)}
    assert targets["c1_vs_llama.cpp"]["value"] == 0.75 and targets["c1_vs_llama.cpp"]["passed"] is False
    assert targets["high_vs_llama.cpp"]["value"] == 2.4 and targets["high_vs_llama.cpp"]["passed"] is True
    assert "concurrency 8 (completion)" in targets["high_vs_llama.cpp"]["description"]
    only_low = peer_comparisons(
        server("lmiserve", "lmi", [completion_level(1, 30.0)], []),
        [server("p", "openai", [completion_level(1, 30.0)], [])],
    )
    targets = {t["id"]: t for t in peer_targets(only_low)}
    assert targets["c1_vs_p"]["passed"] is True and targets["high_vs_p"]["passed"] is None
    assert targets["high_vs_p"]["note"] == "not measured"
    assert peer_comparisons(None, [peer]) == []


def test_the_ab_server_is_compared_with_the_peers_too():
    a = server("lmiserve", "lmi", [completion_level(1, 30.0)], [])
    b = server("lmiserve[dtype=int4]", "lmi", [completion_level(1, 60.0)], [])
    peer = server("llama-server", "openai", [completion_level(1, 50.0)], [])
    comparisons = peer_comparisons(a, [peer]) + peer_comparisons(b, [peer])
    assert [c["server"] for c in comparisons] == ["lmiserve", "lmiserve[dtype=int4]"]
    targets = {t["id"]: t for t in peer_targets(comparisons)}
    assert targets["c1_vs_llama-server"]["value"] == 0.6 and targets["c1_vs_llama-server"]["passed"] is False
    best = targets["c1_vs_llama-server@lmiserve[dtype=int4]"]
    assert best["value"] == 1.2 and best["passed"] is True and "lmiserve[dtype=int4] tokens/s" in best["description"]


def test_forward_targets_per_lmiserve():
    a = {
        "name": "lmiserve",
        "ratios": [{"concurrency": 1, "server_over_forward": 1.1}, {"concurrency": 32, "server_over_forward": 1.31}],
    }
    b = {"name": "B", "ratios": [{"concurrency": 1, "server_over_forward": 1.97}]}
    targets = {t["id"]: t for t in forward_targets([a, b, {"name": "no baselines", "ratios": []}])}
    assert set(targets) == {"c1_vs_forward_15", "c32_vs_forward_15", "c1_vs_forward_15@B", "c32_vs_forward_15@B"}
    assert targets["c1_vs_forward_15"]["passed"] is False and targets["c32_vs_forward_15"]["passed"] is True
    assert targets["c1_vs_forward_15@B"]["passed"] is True and targets["c1_vs_forward_15@B"]["threshold"] == 1.5
    assert targets["c32_vs_forward_15@B"]["passed"] is None and targets["c32_vs_forward_15@B"]["note"] == "not measured"
    assert all(t["issue"] == 15 for t in targets.values())


def test_ab_comparison_and_the_prefix_cache_target():
    a = server("lmiserve", "lmi", [completion_level(1, 30.0)], [chat_level(1, 30.0, 50.0), chat_level(8, 90.0, 90.0)])
    b = server("B", "lmi", [completion_level(1, 29.4)], [chat_level(1, 28.0, 400.0), chat_level(8, 80.0, 300.0)])
    off = ab_comparison(a, b, [("enable_prefix_caching", "false")])
    assert off is not None and off["b_options"] == {"enable_prefix_caching": "false"}
    assert [(r["scenario"], r["concurrency"], r["b_over_a"]) for r in off["throughput"]] == [
        ("completion", 1, 0.98),
        ("chat", 1, 0.933),
        ("chat", 8, 0.889),
    ]
    assert [r["a_over_b"] for r in off["late_turn_ttft"]] == [0.125, 0.3]
    target = prefix_cache_target(off)
    assert target is not None and target["value"] == 0.3 and target["passed"] is False  # the worst level
    assert prefix_cache_target(ab_comparison(a, b, [("max_rolling_batch_size", "8")])) is None
    assert prefix_cache_target(None) is None and ab_comparison(a, None, []) is None


def test_report_and_table_carry_the_chat_scenario():
    meta = {"model": {"name": "M"}, "settings": {"max_new_tokens": 3}, "device": "cpu", "dtype": "float32"}
    servers = [
        server("lmiserve", "lmi", [completion_level(1, 30.0)], [chat_level(1, 30.0, 50.0)]),
        server("lmiserve[enable_prefix_caching=false]", "lmi", [completion_level(1, 30.0)], [chat_level(1, 30, 400.0)])
        | {"ab": True},
        server("llama.cpp", "openai", [completion_level(1, 20.0)], [chat_level(1, 20.0, 60.0)]),
    ]
    report = build_report(meta, servers, None, None, None, [("enable_prefix_caching", "false")])
    b = "lmiserve[enable_prefix_caching=false]"
    # B is not a peer; it is compared with the peers, as A is
    assert [(p["server"], p["peer"]) for p in report["peers"]] == [("lmiserve", "llama.cpp")] * 2 + [
        (b, "llama.cpp")
    ] * 2
    assert report["ab"]["b"] == "lmiserve[enable_prefix_caching=false]"
    targets = {t["id"]: t for t in report["targets"]}
    assert targets["prefix_cache_chat_ttft"]["value"] == 0.125 and targets["prefix_cache_chat_ttft"]["passed"]
    assert targets["c1_vs_llama.cpp"]["value"] == 1.5
    assert targets["exact_tokens"]["passed"] is True
    text = format_table(report)
    assert "chat scenario (per turn" in text and "lmiserve over each peer" in text
    assert "A/B: lmiserve (A) against lmiserve[enable_prefix_caching=false] (B: -o enable_prefix_caching=false)" in text
    assert text.index("targets (issue #5):") < text.index("targets (issue #15):")
    chat_rows = [line.split() for line in text.splitlines() if line.split()[:3] == ["llama.cpp", "1", "1"]]
    assert chat_rows and chat_rows[0][4] == "400.0"  # turn 1's TTFT p50


def test_failed_chat_levels_fail_the_exact_tokens_target():
    bad = chat_level(1, 30.0, 50.0) | {"failed_requests": 2}
    report = build_report({}, [server("lmiserve", "lmi", [completion_level(1, 30.0)], [bad])], None, None)
    assert {t["id"]: t for t in report["targets"]}["exact_tokens"]["value"] == 2


# --- configuration and machine ---------------------------------------------------------------------


def test_two_servers_the_bench_starts_on_one_gpu_each_get_part_of_it(monkeypatch):
    """--ab-option and --lora start a second server: on a GPU each gets `SHARED_GPU_UTILIZATION` of it (two at
    the default 0.9 ran out of memory on an H200), unless an option already sizes the pools; a CPU's default
    budget is shared already."""
    share = [("gpu_memory_utilization", "0.44")]
    ab = [("stream_interval", "8")]
    assert BenchConfig(model_id="m", device="cuda", ab_options=ab).shared_gpu() == share
    assert BenchConfig(model_id="m", options=[("device", "cuda:0")], lora=2).shared_gpu() == share
    assert BenchConfig(model_id="m", device="cuda").shared_gpu() == []  # one server
    assert BenchConfig(model_id="m", device="cpu", ab_options=ab).shared_gpu() == []
    for seen in (True, False):  # device auto: where torch sees a GPU
        monkeypatch.setattr(baselines, "cuda_available", lambda seen=seen: seen)
        assert BenchConfig(model_id="m", ab_options=ab).shared_gpu() == (share if seen else [])
    for sized in ([("gpu_memory_utilization", "0.3")], [("option.kv_cache_memory_bytes", "4GiB")]):
        assert BenchConfig(model_id="m", device="cuda", options=sized, ab_options=ab).shared_gpu() == []
        assert BenchConfig(model_id="m", device="cuda", ab_options=[*ab, *sized]).shared_gpu() == []


def test_scenarios_and_second_server_arguments():
    config = BenchConfig(model_id="m", options=[("max_rolling_batch_size", "8")], dtype="fp32", scenario="both")
    assert config.scenarios == ["completion", "chat"]
    assert BenchConfig(scenario="chat").scenarios == ["chat"]
    assert config.serve_args([("enable_prefix_caching", "false")]) == [
        "--model-id",
        "m",
        "-o",
        "dtype=fp32",
        "-o",
        "max_rolling_batch_size=8",
        "-o",
        "enable_prefix_caching=false",
    ]
