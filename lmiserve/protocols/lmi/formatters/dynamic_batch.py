"""Formatters for ``option.rolling_batch=disable`` (dynamic batch).

Every prompt of the request's ``inputs`` is its own engine request; their events are merged, tagged
with the prompt's position (`merge_tagged`), and one formatter, the pipeline `Encoder` of the HTTP
request, sees them in any interleaving: `DynamicBatchFormatter(prompts)` or
`DynamicBatchStreamFormatter(len(prompts))`.

Decisions:
- Non-streaming: always a list ``[{"generated_text": "..."}, ...]`` in input order, also for a
  single string input. That is what LMI's dynamic-batch handler sends (it returns a slice of the
  batch predictions, and LMI's schema document shows a one-element list for a string input); the
  "single object" LMI's documentation mentions for batch size 1 is not produced by it.
- ``generated_text`` includes the prompt by default: LMI's handler decodes the whole
  ``model.generate`` output, which for causal LMs starts with the prompt. Pass
  ``return_full_text=False`` to get the completion only.
- Streaming (deprecated ``option.enable_streaming``): line k is ``{"outputs": [t0, t1, ...]}`` + "\\n"
  with the k-th token text of every input, so the output is the same whatever order the per-input
  events arrive in. A line is sent as soon as every unfinished input has its k-th token; an input
  that has finished contributes "" (LMI sends the decoded pad token there).
- Errors: before anything was sent the pipeline answers 424 with the compact LMI body, like every
  generation failure (`DynamicBatchFormatter.error`, LMI's handler-failure body, is not sent over
  HTTP: a whole answer has no in-band error); mid-stream, `DynamicBatchStreamFormatter.error` (the
  compact LMI body and "\\n", as for jsonlines).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from lmiserve.core.errors import IncompleteGeneration, LmiServeError
from lmiserve.core.events import Finish, StepEvent
from lmiserve.protocols.lmi.errors import RENDERER, dynamic_batch_error_body
from lmiserve.protocols.lmi.formatters.base import dumps


class DynamicBatchFormatter:
    """``[{"generated_text": ...}, ...]`` once every input has finished."""

    content_type = "application/json"
    streaming = False

    def __init__(self, prompts: Sequence[str], *, return_full_text: bool = True):
        self.prompts = list(prompts)
        self.return_full_text = return_full_text
        self._finishes: list[Finish | None] = [None] * len(self.prompts)

    def on_event(self, input_index: int, event: StepEvent) -> bytes:
        if event.finish is not None and event.index == 0:
            self._finishes[input_index] = event.finish
        return b""

    def close(self) -> bytes:
        missing = [i for i, f in enumerate(self._finishes) if f is None]
        if missing:
            raise IncompleteGeneration(f"inputs {missing} ended without a finish event")
        body = []
        for prompt, finish in zip(self.prompts, self._finishes):
            assert finish is not None
            text = prompt + finish.generated_text if self.return_full_text else finish.generated_text
            body.append({"generated_text": text})
        return dumps(body).encode()

    def error(self, exc: LmiServeError) -> bytes:
        return dynamic_batch_error_body(exc.message)


class DynamicBatchStreamFormatter:
    """``{"outputs": [...]}`` lines, one per generation step across all inputs."""

    content_type = "application/jsonlines"
    streaming = True

    def __init__(self, num_inputs: int):
        self._pending: list[deque[str]] = [deque() for _ in range(num_inputs)]
        self._done = [False] * num_inputs

    def on_event(self, input_index: int, event: StepEvent) -> bytes:
        if event.index != 0:
            return b""
        if event.token is not None:
            self._pending[input_index].append(event.token.text)
        if event.finish is not None:
            self._done[input_index] = True
        return self._drain(final=False)

    def close(self) -> bytes:
        return self._drain(final=True)

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc) + b"\n"

    def _drain(self, final: bool) -> bytes:
        lines = []
        while any(self._pending):
            waiting = any(not q and not done for q, done in zip(self._pending, self._done))
            if waiting and not final:
                break
            outputs = [q.popleft() if q else "" for q in self._pending]
            lines.append(dumps({"outputs": outputs}) + "\n")
        return "".join(lines).encode()
