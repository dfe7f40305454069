"""The fast forward's steps over a model whose layers the packed CPU kernels take (`q4_decode`), run both ways: through
`FastLlama.packed` (each layer in four kernel calls) and op by op; each step's logits against transformers' forward."""

from __future__ import annotations

import torch

from lmiserve.engine.attention.paged import paged_cache
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs

SEQ = [1, 5, 9, 17, 33, 40, 7, 3]


@torch.inference_mode()
def packed_and_op_by_op_give_transformers_logits(model: torch.nn.Module, seq: list[int] = SEQ) -> None:
    """A prompt chunk of 5 tokens, then one decode row a step, through the packed kernels (which must run: one call a
    step) and through the op-by-op layers, each step's logits those of transformers' forward over the same modules."""
    reference = model(torch.tensor([seq])).logits[0]
    for packed in (True, False):
        fast = FastLlama(model, paged_cache(model, 4, 4), 128)
        assert fast.packed is not None
        calls: list[int] = []
        if packed:
            run = fast.packed.run
            fast.packed.run = lambda *a, run=run, calls=calls: calls.append(1) or run(*a)  # type: ignore[method-assign]
        else:
            fast.packed = None
        table = [2, 0, 3]
        out = fast.forward(StepInputs(chunks=[(table, 0, seq[:5])], keep=[*range(5)]))
        torch.testing.assert_close(out, reference[:5], rtol=1e-4, atol=1e-4)
        for position in range(5, len(seq)):
            out = fast.forward(StepInputs([seq[position]], [position], [table], keep=[0]))
            torch.testing.assert_close(out[0], reference[position], rtol=1e-4, atol=1e-4)
        assert len(calls) == (len(seq) - 5 + 1 if packed else 0)
