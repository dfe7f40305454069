"""What the serving layers need of an engine, whatever runs the model behind it.

`ModelEngine` is what a served model runs on (the continuous-batching text generator or the
dynamic batcher of a one-shot model): started once the model is loaded, stopped when it is
unloaded. `TextGenerator` is the generative engine every text protocol talks to.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from lmiserve.core.events import StepEvent
from lmiserve.core.request import GenerationRequest
from lmiserve.core.stats import EngineObserver, EngineSnapshot


class ModelEngine(Protocol):
    def start(self) -> None:
        """Start the background loop (on the running event loop); idempotent."""
        ...

    async def stop(self) -> None:
        """Stop the loop; requests still waiting end with ModelNotReady instead of hanging."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests (sequences) queued for a place in the batch."""
        ...


class TextGenerator(ModelEngine, Protocol):
    def generate(self, request: GenerationRequest) -> AsyncGenerator[StepEvent, None]:
        """The events of one request: one per token of each sequence, the last one of a sequence with
        `finish` set. With n / best_of > 1 the sequences come whole, best first (a request that is
        not `ranked`: as they are generated, interleaved, with n == best_of). Invalid or
        unadmittable requests raise (InvalidRequest, Overloaded, QueueTimeout, ModelNotReady) from
        the iteration; closing the iterator aborts the request's sequences."""
        ...

    async def prepare(self, request: GenerationRequest) -> None:
        """Do what can refuse the request itself before generation starts (compile its grammar, cached,
        off the engine thread; encode and check its prompt; check that its prompt and max_new_tokens
        fit the KV cache at all); raises InvalidRequest. `generate` does it too: a protocol calls this
        first when it must answer a bad request before its response starts (a stream's 200)."""
        ...

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        ...

    def snapshot(self) -> EngineSnapshot:
        """The live state: running and waiting sequences, the batch's token budget, KV cache use."""
        ...

    def add_observer(self, observer: EngineObserver) -> None:
        """Report requests and steps to `observer` from now on (lmiserve.core.stats)."""
        ...
