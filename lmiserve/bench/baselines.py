"""In-process baselines of `lmiserve bench` (the only bench module that imports torch):

(a) the bare model forward: a transformers model with a `DynamicCache`, left-padded prefill then a
    greedy argmax loop, N tokens per sequence, under `torch.inference_mode()` — the ceiling of the
    model code at that batch size;
(b) `model.generate` static batching of the same prompts (left padding, greedy,
    min_new_tokens = max_new_tokens = N);
(c) with `--json-schema`, `measure_grammar`: compile times and the per-step mask cost of the schema
    (see `lmiserve.bench.structured`).

The model is loaded through `lmiserve.config` + `lmiserve.models` exactly as the server loads it
(same model id, revision, cache dir, device and dtype). CUDA work is synchronised before every
clock read.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from lmiserve.bench.prompts import batch_prompts
from lmiserve.bench.structured import Json, Log

if TYPE_CHECKING:
    from lmiserve.models.load import LoadedModel


def run_info(loaded: LoadedModel) -> dict[str, Any]:
    """Where a baseline ran: the device, dtype, model folder and torch's threads (each report's `info`)."""
    return {
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "model_path": str(loaded.path),
        "threads": torch.get_num_threads(),
    }


def load_like_server(overrides: Mapping[str, Any]) -> LoadedModel:
    """The `LoadedModel` the server would load with these settings overrides (-o options etc.)."""
    from lmiserve.config import load_settings
    from lmiserve.models.load import load_causal_lm
    from lmiserve.models.resolve import resolve_model_path

    settings = load_settings(dict(overrides))
    path = resolve_model_path(settings.model_id, settings.revision, settings.model_cache_dir)
    return load_causal_lm(
        path,
        dtype=settings.dtype,
        device=settings.device,
        trust_remote_code=settings.trust_remote_code,
        load_format=settings.load_format,
    )


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (for the bench's torch-free modules: `BenchConfig.shared_gpu`)."""
    return torch.cuda.is_available()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _encode(loaded: LoadedModel, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    tokenizer = loaded.tokenizer
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        encoded = tokenizer(list(prompts), return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    return {k: v.to(loaded.device) for k, v in encoded.items() if k in ("input_ids", "attention_mask")}


@torch.inference_mode()
def forward_decode(loaded: LoadedModel, prompts: Sequence[str], max_new_tokens: int) -> dict[str, Any]:
    """Greedy decode of `prompts` as one batch with the bare forward; times prefill and decode."""
    model, device = loaded.model, loaded.device
    batch = _encode(loaded, prompts)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    _sync(device)
    t0 = time.perf_counter()
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    token = out.logits[:, -1, :].argmax(dim=-1)
    _sync(device)
    t1 = time.perf_counter()
    generated = [token]
    position = positions[:, -1:]
    ones = torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=device)
    for _ in range(max_new_tokens - 1):
        mask = torch.cat([mask, ones], dim=1)
        position = position + 1
        out = model(
            input_ids=token[:, None], attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True
        )
        token = out.logits[:, -1, :].argmax(dim=-1)
        generated.append(token)
    _sync(device)
    t2 = time.perf_counter()
    tokens = torch.stack(generated, dim=1)
    batch_size, steps = tokens.shape
    decode_s = t2 - t1
    return {
        "batch_size": batch_size,
        "tokens": batch_size * steps,
        "prefill_s": round(t1 - t0, 4),
        "decode_s": round(decode_s, 4),
        # N-1 decode steps follow the prefill (which yields the first token)
        "decode_tokens_per_s": round(batch_size * (steps - 1) / decode_s, 2) if steps > 1 and decode_s > 0 else None,
        "total_tokens_per_s": round(batch_size * steps / (t2 - t0), 2),
    }


@torch.inference_mode()
def generate_static(loaded: LoadedModel, prompts: Sequence[str], max_new_tokens: int) -> dict[str, Any]:
    """`model.generate` on `prompts` as one left-padded greedy batch of exactly N new tokens."""
    model: Any = loaded.model  # transformers' stubs type `generate` as a Tensor (nn.Module.__getattr__)
    device, tokenizer = loaded.device, loaded.tokenizer
    batch = _encode(loaded, prompts)
    prompt_len = batch["input_ids"].shape[1]
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        **batch,
        do_sample=False,
        min_new_tokens=max_new_tokens,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    _sync(device)
    seconds = time.perf_counter() - t0
    new = out.shape[1] - prompt_len
    if new != max_new_tokens:
        raise RuntimeError(f"model.generate produced {new} new tokens instead of {max_new_tokens}")
    tokens = out.shape[0] * new
    return {
        "batch_size": out.shape[0],
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
    }


def generate_continuous(loaded: LoadedModel, prompts: Sequence[str], max_new_tokens: int) -> dict[str, Any]:
    """transformers' own continuous batching (`model.generate_batch`: paged attention, its scheduler) on
    `prompts`, greedy, N new tokens each (the end-of-sequence token disabled, as the server's
    ignore_eos_token). Not under inference mode: its generation thread updates the cache it builds."""
    from transformers import GenerationConfig

    model: Any = loaded.model
    tokenizer = loaded.tokenizer
    inputs = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=-1,  # never produced: every request makes N tokens
        pad_token_id=tokenizer.pad_token_id,
    )
    _sync(loaded.device)
    t0 = time.perf_counter()
    outputs = model.generate_batch(inputs, generation_config=config, progress_bar=False)
    _sync(loaded.device)
    seconds = time.perf_counter() - t0
    failed = [o.error for o in outputs.values() if o.error]
    if failed:
        raise RuntimeError(f"generate_batch failed: {failed[0]}")
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return {
        "batch_size": len(prompts),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
    }


def run_baselines(
    overrides: Mapping[str, Any],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Both baselines at every batch size (one short untimed warm-up first), and on CUDA transformers'
    continuous batching (`generate_batch`) too; frees the model after."""
    loaded = load_like_server(overrides)
    try:
        info = run_info(loaded)
        forward_decode(loaded, batch_prompts(1), 2)
        forward, generate, continuous = [], [], []
        hf_continuous = loaded.device.type == "cuda" and hasattr(loaded.model, "generate_batch")
        if hf_continuous:
            generate_continuous(loaded, batch_prompts(2), 2)  # its warm-up (CUDA graphs) outside the timing
        for size in batch_sizes:
            prompts = batch_prompts(size)
            forward.append(forward_decode(loaded, prompts, max_new_tokens))
            log(f"  bare forward  batch {size:>3}: {forward[-1]['decode_tokens_per_s']} decode tokens/s")
            generate.append(generate_static(loaded, prompts, max_new_tokens))
            log(f"  generate      batch {size:>3}: {generate[-1]['tokens_per_s']} tokens/s")
            if hf_continuous:
                continuous.append(generate_continuous(loaded, prompts, max_new_tokens))
                log(f"  generate_batch batch {size:>3}: {continuous[-1]['tokens_per_s']} tokens/s")
        result = {**info, "forward": forward, "generate": generate}
        return {**result, "continuous": continuous} if hf_continuous else result
    finally:
        del loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def measure_grammar(
    overrides: Mapping[str, Any], schema: Json, batch_sizes: Sequence[int], steps: int, log: Log
) -> Json:
    """Compile times and per-step mask cost of `schema` on the served model's tokenizer (see
    `lmiserve.bench.structured`). Loads the model as the server does (tokenizer, vocabulary, EOS)."""
    from lmiserve.core.grammar import Grammar
    from lmiserve.engine.text.grammar_compiler import GrammarCompiler
    from lmiserve.engine.text.token_mask import TokenMask

    loaded = load_like_server(overrides)
    vocab = int(getattr(loaded.model.config, "vocab_size", None) or len(loaded.tokenizer))
    eos = sorted(loaded.eos_token_ids)
    grammar = Grammar("json_schema", json.dumps(schema, ensure_ascii=False))
    del loaded.model  # only the tokenizer is needed from here

    compiler = GrammarCompiler(loaded.tokenizer, vocab_size=vocab, eos_token_ids=eos)
    t0 = time.perf_counter()
    compiler._llg_tokenizer()  # noqa: SLF001 - timed apart: paid once per model, not per schema
    t1 = time.perf_counter()
    compiled = compiler.compile(grammar)
    t2 = time.perf_counter()
    first = TokenMask(vocab, eos)
    first.fill([compiled.matcher()])  # the library finishes some of the compile work lazily
    t3 = time.perf_counter()
    cached = []
    for _ in range(20):
        start = time.perf_counter()
        compiler.compile(grammar).matcher()
        cached.append(time.perf_counter() - start)
    compile_figures = {
        "tokenizer_build_ms": _ms(t1 - t0),
        "cold_compile_ms": _ms(t2 - t1),
        "cold_first_mask_ms": _ms(t3 - t2),
        "cached_compile_ms": _ms(statistics.median(cached)),
    }
    log(
        f"  grammar: tokenizer {compile_figures['tokenizer_build_ms']} ms (once per model), cold compile "
        f"{compile_figures['cold_compile_ms']} ms + first mask {compile_figures['cold_first_mask_ms']} ms, "
        f"cached {compile_figures['cached_compile_ms']} ms"
    )

    mask_rows = []
    generator = torch.Generator().manual_seed(0)
    for batch in batch_sizes:
        mask = TokenMask(vocab, eos)
        matchers = [compiled.matcher() for _ in range(batch)]
        fills, applies = [], []
        for _ in range(steps):
            logits = torch.randn((batch, vocab), generator=generator)
            start = time.perf_counter()
            mask.fill(matchers)
            filled = time.perf_counter()
            copies = logits[list(range(batch))]  # what `ModelRunner._mask_rows` does: copy the rows, mask them
            mask.apply(copies, matchers)
            applies.append(time.perf_counter() - filled)
            fills.append(filled - start)
            for row, token in enumerate(copies.argmax(-1).tolist()):
                if not matchers[row].accept(token) or matchers[row].is_stopped:
                    matchers[row] = compiled.matcher()  # completed (a user schema): start a new sequence
        fill, apply = statistics.median(fills), statistics.median(applies)
        mask_rows.append(
            {
                "batch_size": batch,
                "steps": steps,
                "fill_ms": _ms(fill),
                "step_mask_ms": _ms(apply),
                "per_row_us": round(apply / batch * 1e6, 1),
            }
        )
        log(f"  mask at batch {batch}: {_ms(apply)} ms a step (bitmask fill alone {_ms(fill)} ms)")
    compiler.close()
    return {"compile": compile_figures, "mask": mask_rows, "vocab_size": vocab}
