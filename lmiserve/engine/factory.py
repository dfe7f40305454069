"""Build the engine for a loaded model from the server settings."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lmiserve.engine.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.grammar_compiler import GrammarCompiler
from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.runners import ModelRunner, create_runner
from lmiserve.engine.tokenizer import HfTokenizer
from lmiserve.engine.validation import PromptCodec

if TYPE_CHECKING:
    from lmiserve.config import Settings

# Prompt tokens a step that also decodes may take at least (it takes max(floor, decoding rows)).
# CPU: a step's cost is ~ weight read + tokens x per-token compute; 16 extra tokens at most double
# a 1-row decode step and add ~1/3 to a 32-row one (benchmarks/README.md, "prefill budget").
# GPU: a step costs about the same up to hundreds of tokens (not measured here).
PREFILL_FLOOR = {"cpu": 16, "cuda": 256}


def engine_config(settings: Settings) -> EngineConfig:
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
        cpu_autotune=settings.cpu_autotune,
        autotune_cache=settings.autotune_cache,
        prefill_floor=settings.prefill_tokens_while_decoding or "auto",
        prefix_cache_bytes=int(settings.prefix_cache_size) if settings.enable_prefix_caching else 0,
    )


def build_engine(loaded: LoadedModel, settings: Settings) -> AsyncEngine:
    return create_engine(loaded, engine_config(settings), max_input_len=settings.max_input_len)


def create_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    max_input_len: int | None = None,
    runner_cls: type[ModelRunner] | None = None,
) -> AsyncEngine:
    """The engine for `loaded`; the runner strategy follows `config` unless `runner_cls` is given."""
    if config.prefill_floor == "auto":
        config = dataclasses.replace(config, prefill_floor=PREFILL_FLOOR.get(loaded.device.type, 256))
    if runner_cls is None:
        runner = create_runner(
            loaded.model,
            max_slots=config.max_running,
            max_context=loaded.max_context,
            eos_token_ids=loaded.eos_token_ids,
            batch_invariant=config.batch_invariant,
            fast_path=config.fast_path,
            autotune=config.cpu_autotune,
            autotune_cache=config.autotune_cache,
        )
    else:
        runner = runner_cls(
            loaded.model,
            max_slots=config.max_running,
            max_context=loaded.max_context,
            eos_token_ids=loaded.eos_token_ids,
        )
    codec = PromptCodec(
        HfTokenizer(loaded.tokenizer),
        eos_token_ids=loaded.eos_token_ids,
        max_context=loaded.max_context,
        max_input_len=max_input_len,
        vocab_size=getattr(loaded.model.config, "vocab_size", None),
    )
    grammars = GrammarCompiler(loaded.tokenizer, vocab_size=codec.vocab_size, eos_token_ids=loaded.eos_token_ids)
    return AsyncEngine(runner, codec, config, grammars)
