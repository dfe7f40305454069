"""`lmiserve bench`'s reading of the server's steps over a level (lmiserve/bench/steps.py): the differences
of TGI's forward-duration histogram by method (a real server: tests/integration/test_bench.py)."""

from __future__ import annotations

from types import SimpleNamespace

from lmiserve.bench.server import free_port
from lmiserve.bench.steps import level_steps, read_steps


def test_a_levels_steps_are_the_differences_of_the_readings():
    before = {"prefill": (10.0, 0.5), "decode": (100.0, 1.0)}
    after = {"prefill": (30.0, 1.3), "decode": (400.0, 4.0)}
    assert level_steps(before, after) == {
        "prefill_steps": 20,
        "decode_steps": 300,
        "prefill_share": 0.062,
        "prefill_step_ms": 40.0,
        "decode_step_ms": 10.0,
        "prefill_over_decode": 4.0,
    }
    # a level of decode steps alone (prompts cached before it, say): no prefill mean, no ratio
    only = level_steps({"decode": (0.0, 0.0)}, {"decode": (5.0, 0.05)})
    assert only is not None and only["prefill_steps"] == 0 and only["prefill_step_ms"] is None
    assert only["prefill_over_decode"] is None and only["decode_step_ms"] == 10.0


def test_no_reading_no_figures():
    reading = {"prefill": (1.0, 0.1), "decode": (1.0, 0.1)}
    assert level_steps(None, reading) is None and level_steps(reading, None) is None
    assert level_steps(reading, reading) is None  # no step in the level
    closed = SimpleNamespace(url=f"http://127.0.0.1:{free_port()}/v1", api_key=None)
    assert read_steps(closed, timeout=2.0) is None  # nothing answers: no figures, no failure
