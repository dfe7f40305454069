"""A vision-language model whose decoder is one lmiserve's own forward runs (LLaVA and LLaVA-NeXT over Llama,
Mistral or Qwen2, Idefics3/SmolVLM, Gemma 3 4B-27B, Qwen2-VL, Qwen2.5-VL, Qwen3-VL; docs/engine.md,
"Vision-language models"): its steps run that forward (engine/model/fast_llama.py) over the decoder
(engine/model/language_model.py), each image token's embedding replaced by its image feature, and on CUDA its
decode steps replay the decode graphs, as a text model's do. The image encoder runs once per image at admission,
as runner/vision.py's.

**M-RoPE** (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a text token's three positions are one, its position shifted by
what the images before it took (``get_rope_index``; a generated token's: the prompt's rope delta), and RoPE at
three equal positions is the 1-D RoPE of that position: the fast forward rotates such a row's tokens at their
position plus the row's shift (`StepInputs.rope_shifts`; the decode graphs take it as an input too).

The Qwen VLs' image tokens take RoPE rows made from their 3-D positions by the rotary module
(`StepInputs.rope_rows`); Qwen3-VL's DeepStack features are added at its image tokens after its first layers
(`StepInputs.deepstack`); Gemma 3's image tokens see each other both ways (`StepInputs.opens`: the scheduler never
splits such an image, and the step's attention runs on the torch backend with the image's block opened).

Every step runs it: a row with a LoRA adapter (its decoder's linears, named by their paths in the VLM: the fast
forward's groups, in the decode graphs too), and a row that meets an M-RoPE image and runs on past its prompt (a
recompute after a preemption), which takes the prompt's 3-D positions, then each generated token's position plus
the prompt's rope delta, three times. (Transformers' forward of the VLM, runner/vision.py's, runs a VLM whose decoder
lmiserve's forward does not.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmiserve.engine import host_copy
from lmiserve.engine.attention import cuda_graphs
from lmiserve.engine.attention.kv_quant import KvFormat
from lmiserve.engine.core.step import StepBatch
from lmiserve.engine.lora.batch import LoraBatch
from lmiserve.engine.model.language_model import language_model
from lmiserve.engine.model.step_inputs import StepInputs
from lmiserve.engine.runner import fast_reason
from lmiserve.engine.runner.fast import fast_forward, step_inputs
from lmiserve.engine.runner.generic import Span
from lmiserve.engine.runner.persistent_batch import PersistentBatchRunner
from lmiserve.engine.runner.request_state import RequestState
from lmiserve.engine.runner.vision import NO_SHIFT, PagedVisionRunner, opened_spans

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["PagedFastVisionRunner", "fast_vision_reason"]


def fast_vision_reason(model: PreTrainedModel, *, fast_path: bool, lora: bool = False) -> str | None:
    """Why lmiserve's own forward does not run the vision-language model `model`'s decoder (None: it does);
    `lora`: whether adapters are configured (no VLM decoder lmiserve runs has experts: `fast_reason`)."""
    view = language_model(model)
    if view is None:
        return "a vision-language model whose decoder is not found"
    reason = fast_reason(view, fast_path=fast_path)  # type: ignore[arg-type]
    return None if reason is None else f"a vision-language model whose decoder is not served: {reason}"


class PagedFastVisionRunner(PagedVisionRunner):
    """`PagedVisionRunner` whose steps run lmiserve's forward of the decoder where it computes them."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_slots: int,
        max_context: int,
        eos_token_ids: Iterable[int],
        num_blocks: int,
        block_size: int,
        autotune: bool = False,
        autotune_cache: str | None = None,
        enforce_eager: bool = False,
        kv_format: KvFormat | None = None,
        graph_prompt_tokens: int = 0,
    ) -> None:
        """As `PagedFastRunner`'s (runner/fast.py)."""
        graphs = cuda_graphs.wanted(model.device, enforce_eager)
        # with decode graphs, one block past the pool's: where their padding rows write (no sequence holds it)
        super().__init__(
            model, eos_token_ids=eos_token_ids, num_blocks=num_blocks, block_size=block_size, kv_format=kv_format,
            scratch_blocks=int(graphs),
        )  # fmt: skip
        view = language_model(model)
        if view is None:  # (`fast_vision_reason` is asked first)
            raise ValueError("the vision-language model's decoder is not found")
        self.fast, self.kernels, self.graphs = fast_forward(
            view, self.kv, max_context, max_slots, (autotune, autotune_cache), graph_prompt_tokens if graphs else None
        )
        for group in self.fast.lora_groups():  # (the decoder's linears, by their paths in the VLM)
            self.lora_stacks.add_group(group)
        self.path = "fast"
        # the steps each forward ran: lmiserve's, and transformers' forward of the VLM (none: every step is lmiserve's,
        # adapters' and recomputes' too)
        self.steps = {"fast": 0, "vlm": 0}

    def _lora(self, batch: StepBatch, part: list[int], tokens: list[int]) -> LoraBatch | None:
        """The rows' adapters, applied by lmiserve's forward to the decoder's groups (no hooks on the VLM's modules,
        which transformers' forward would need)."""
        return PersistentBatchRunner._lora(self, batch, part, tokens)

    def _forward_rows(self, batch: StepBatch, part: list[int]) -> torch.Tensor:
        states = [self._requests[batch.rows[i].seq_id] for i in part]
        rows = [batch.rows[i] for i in part]
        spans = [(r.start, len(r.computed_ids)) for r in rows]
        shifts = [self._shift(s, *span) for s, span in zip(states, spans)]
        # the rows that meet an M-RoPE image (their tokens' three positions differ): RoPE rows of their own
        three = [n for n, shift in enumerate(shifts) if shift is None]
        self.steps["fast"] += 1
        lora = self._lora(batch, part, [1 if i < batch.num_decode else len(batch.rows[i].computed_ids) for i in part])
        step = step_inputs(batch, part, self._requests, self._kept, {}, lora)
        step.rope_shifts = [shift or 0 for shift in shifts] if any(shifts) else None
        decode = len(step.decode_ids)  # (Gemma 3's images, both ways: in prompt chunks alone)
        opens = [opened_spans(s, *span) for s, span in zip(states[decode:], spans[decode:], strict=True)]
        step.opens = opens if any(opens) else None
        flat = _flat_spans(step)
        if three:
            step.rope_rows = self._rope_rows([states[n] for n in three], [flat[n] for n in three])
        return self.fast.forward(self._with_images(step, states, flat))

    def _rope_rows(
        self, states: list[RequestState], spans: list[Span]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`StepInputs.rope_rows` of some of the step's rows (their `states` and `_flat_spans`): their M-RoPE
        positions (`_positions_3d`) through the rotary module."""
        at = np.concatenate([np.arange(first, first + count) for first, count, _, _ in spans])
        three = [_positions_3d(s, start, count) for s, (_, count, start, _) in zip(states, spans)]
        cos, sin = self.fast.rope.rows_at(torch.cat(three, dim=1))
        return host_copy.to_device(at, self.device), cos, sin

    @staticmethod
    def _shift(state: RequestState, start: int, count: int) -> int | None:
        """The RoPE shift of a row's tokens (M-RoPE's text: one for the whole row), None where they have none
        (the row meets an M-RoPE image, whose tokens' three positions differ: `_rope_rows`)."""
        features = state.images
        shifts = features.shifts if features is not None else None
        if features is None or shifts is None:
            return 0
        prompt = len(shifts)
        within = shifts[start : min(start + count, prompt)]
        past = [features.delta] if start + count > prompt else []  # (generated tokens: the prompt's delta)
        found = {*within.tolist(), *past}
        return found.pop() if len(found) == 1 and NO_SHIFT not in found else None

    def _with_images(self, step: StepInputs, states: list[RequestState], spans: list[Span]) -> StepInputs:
        """`step` with the image features of the image tokens it covers (the rows' `states` and `_flat_spans`)."""
        found = self._image_rows(states, spans)
        if found is None:
            return step
        where, index, take_rows = found
        ids, _ = step.tokens()
        for at in where.tolist():
            ids[at] = 0  # (an image token may lie outside the vocabulary: its embedding is replaced)
        decode = len(step.decode_ids)
        chunks, at = [], decode
        for table, start, chunk in step.chunks:
            chunks.append((table, start, ids[at : at + len(chunk)]))
            at += len(chunk)
        features = torch.cat([f.features[r] for f, r in take_rows])
        layers = len(take_rows[0][0].deepstack or [])  # (Qwen3-VL's DeepStack features: one set a layer)
        deep = [torch.cat([f.deepstack[k][r] for f, r in take_rows if f.deepstack]) for k in range(layers)] or None
        embeds = (index, features)
        return dataclasses.replace(step, decode_ids=ids[:decode], chunks=chunks, embeds=embeds, deepstack=deep)


def _positions_3d(state: RequestState, start: int, count: int) -> torch.Tensor:
    """``[3, count]``: the M-RoPE positions of a row's tokens from `start`: its prompt's (``get_rope_index``'s), then
    past the prompt (a recompute's generated tokens) each position plus the prompt's rope delta, three times."""
    features = state.images
    assert features is not None and features.mrope is not None
    mrope, end = features.mrope, start + count
    length = mrope.shape[1]
    inside: torch.Tensor = mrope[:, start : min(end, length)]
    if end <= length:
        return inside
    past = torch.arange(max(start, length), end, device=mrope.device) + features.delta
    return torch.cat([inside, past.to(mrope.dtype).expand(3, -1)], dim=1)


def _flat_spans(step: StepInputs) -> list[Span]:
    """Each row of `step` as its first token among the step's flattened tokens, its tokens and its start position
    (and an unused key offset), in the step's order."""
    spans: list[Span] = []
    first = 0
    for position in step.decode_positions:
        spans.append((first, 1, position, 0))
        first += 1
    for _, start, chunk in step.chunks:
        spans.append((first, len(chunk), start, 0))
        first += len(chunk)
    return spans
