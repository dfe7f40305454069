"""Build the engine for a loaded model from the server settings."""

from __future__ import annotations

from lmiserve.engine.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.runner import ModelRunner
from lmiserve.engine.validation import PromptCodec


def engine_config(settings) -> EngineConfig:
    static = settings.dynamic_batching
    return EngineConfig(
        max_running=settings.batch_size if static else settings.max_rolling_batch_size,
        max_prefill_tokens=settings.max_rolling_batch_prefill_tokens,
        job_queue_size=settings.job_queue_size,
        predict_timeout=settings.predict_timeout,
        static_batching=static,
        batch_size=settings.batch_size,
        max_batch_delay=settings.max_batch_delay / 1000.0,
        batch_invariant=settings.batch_invariant,
        fast_path=settings.fast_path,
    )


def build_engine(loaded, settings) -> AsyncEngine:
    return create_engine(loaded, engine_config(settings), max_input_len=settings.max_input_len)


def create_engine(loaded, config: EngineConfig, *, max_input_len: int | None = None, runner_cls=ModelRunner) -> AsyncEngine:
    runner = runner_cls(
        loaded.model,
        max_slots=config.max_running,
        max_context=loaded.max_context,
        eos_token_ids=loaded.eos_token_ids,
        batch_invariant=config.batch_invariant,
        fast_path=config.fast_path,
    )
    codec = PromptCodec(
        loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        max_context=loaded.max_context,
        max_input_len=max_input_len,
        vocab_size=getattr(loaded.model.config, "vocab_size", None),
    )
    return AsyncEngine(runner, codec, config)
