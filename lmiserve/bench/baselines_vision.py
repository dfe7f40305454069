"""The vision scenario's in-process baseline (`lmiserve bench --scenario vision`): transformers'
`model.generate` on the processor's output for the requests the server gets (bench/vision.py: request
`k` is image `k` and question `k`), at batch size B the requests 0 .. B-1, greedy, exactly N new tokens
(min_new_tokens = max_new_tokens = N), with the pixel inputs the processor makes (pixel_values and the
family's extras: image sizes, grids...).

A batch is one left-padded `processor(text=..., images=...)` call and one `generate()`. Where the
processor or the model cannot batch (a processor without padding, a model whose generate refuses a
padded batch of images), the batch's requests run one after another instead and the row says so
(``"batched": false`` and the reason): that is what `generate()` offers such a model.

The timing is `generate()` alone (the vision encoder runs inside it); the processor's time (decoding
aside: the images are already decoded) is reported beside it as ``preprocess_s``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmiserve.bench.baselines import load_like_server, run_info
from lmiserve.bench.vision import IMAGE_SIZE, draw_image, question

if TYPE_CHECKING:
    from lmiserve.models.load import LoadedModel


def chat_texts(processor: Any, numbers: Sequence[int]) -> list[str]:
    """The prompts (the processor's chat template, generation prompt added) of requests `numbers`: one
    user message each, its image then its question, as the server's chat route builds them."""
    texts = []
    for number in numbers:
        content = [{"type": "image"}, {"type": "text", "text": question(number)}]
        messages = [{"role": "user", "content": content}]
        texts.append(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return texts


def processor_inputs(
    loaded: LoadedModel, numbers: Sequence[int], size: tuple[int, int] = IMAGE_SIZE
) -> dict[str, torch.Tensor]:
    """The model's inputs for requests `numbers` as one left-padded batch, on the model's device (the
    floating ones, pixel values, in its dtype)."""
    processor = vision_processor(loaded)
    texts = chat_texts(processor, numbers)
    images = [[draw_image(number, size)] for number in numbers]
    tokenizer = processor.tokenizer
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        batch = processor(text=texts, images=images, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    return {
        key: value.to(loaded.device, loaded.dtype) if value.is_floating_point() else value.to(loaded.device)
        for key, value in batch.items()
        if isinstance(value, torch.Tensor)
    }


def vision_processor(loaded: LoadedModel) -> Any:
    """The loaded model's processor; a model without one takes no images."""
    processor = loaded.processor
    if processor is None:
        raise RuntimeError(f"{loaded.name} is not a vision-language model (it has no processor): --scenario vision")
    return processor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _generate(loaded: LoadedModel, inputs: dict[str, torch.Tensor], max_new_tokens: int) -> tuple[int, float]:
    """(new tokens of all rows, seconds) of one greedy `generate()` of exactly `max_new_tokens` tokens."""
    model: Any = loaded.model  # transformers' stubs type `generate` as a Tensor (nn.Module.__getattr__)
    prompt_len = inputs["input_ids"].shape[1]
    _sync(loaded.device)
    start = time.perf_counter()
    out = model.generate(
        **inputs,
        do_sample=False,
        min_new_tokens=max_new_tokens,
        max_new_tokens=max_new_tokens,
        pad_token_id=vision_processor(loaded).tokenizer.pad_token_id,
    )
    _sync(loaded.device)
    seconds = time.perf_counter() - start
    new = out.shape[1] - prompt_len
    if new != max_new_tokens:
        raise RuntimeError(f"model.generate produced {new} new tokens instead of {max_new_tokens}")
    return out.shape[0] * new, seconds


def generate_vision(
    loaded: LoadedModel, numbers: Sequence[int], max_new_tokens: int, size: tuple[int, int] = IMAGE_SIZE
) -> dict[str, Any]:
    """`model.generate` on requests `numbers` as one batch (one by one where it cannot batch)."""
    started = time.perf_counter()
    note = None
    try:
        batches = [processor_inputs(loaded, numbers, size)]
        preprocess = time.perf_counter() - started
        tokens, seconds = _generate(loaded, batches[0], max_new_tokens)
    except Exception as exc:  # noqa: BLE001 - any refusal of a batch: the requests one by one, said in the row
        if len(numbers) == 1:
            raise
        note = f"one by one: the batch failed ({type(exc).__name__}: {str(exc)[:200]})"
        started = time.perf_counter()
        batches = [processor_inputs(loaded, [number], size) for number in numbers]
        preprocess = time.perf_counter() - started
        runs = [_generate(loaded, inputs, max_new_tokens) for inputs in batches]
        tokens, seconds = sum(t for t, _ in runs), sum(s for _, s in runs)
    prompt_tokens = [int(row.sum()) for inputs in batches for row in inputs["attention_mask"]]
    row = {
        "batch_size": len(numbers),
        "batched": note is None,
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
        "preprocess_s": round(preprocess, 4),
        "prompt_tokens_mean": round(sum(prompt_tokens) / len(prompt_tokens), 1),
    }
    return row if note is None else {**row, "note": note}


def run_vision_baselines(
    overrides: Mapping[str, Any],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    log: Callable[[str], None] = print,
    size: tuple[int, int] = IMAGE_SIZE,
) -> dict[str, Any]:
    """`generate_vision` at every batch size (requests 0 .. B-1; one short untimed warm-up first); frees
    the model after."""
    loaded = load_like_server(overrides)
    try:
        info = {**run_info(loaded), "image_size": list(size)}
        _generate(loaded, processor_inputs(loaded, [0], size), 2)
        rows = []
        for batch in batch_sizes:
            rows.append(generate_vision(loaded, range(batch), max_new_tokens, size))
            how = "" if rows[-1]["batched"] else " (one by one)"
            log(f"  generate (vision) batch {batch:>3}: {rows[-1]['tokens_per_s']} tokens/s{how}")
        return {**info, "generate": rows}
    finally:
        del loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
