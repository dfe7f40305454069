"""The engine's event streams of one TGI/OpenAI request, tagged with their request index."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

from lmiserve.core.errors import GenerationFailed, ModelNotReady
from lmiserve.core.request import GenerationRequest
from lmiserve.server.pipeline import Tagged, merge_tagged, tagged


async def prepare(engine: Any, requests: Sequence[GenerationRequest]) -> None:
    """What the engine refuses of a request itself, found before the response starts (`TextGenerator.prepare`):
    a bad grammar (malformed schema, invalid regex), a prompt the engine refuses, a request whose prompt
    and max_new_tokens never fit the KV pool. A streamed request then gets the protocol's answer to an
    invalid request (its 4xx; a TGI native stream's in-band error), as the whole one does, not a 200
    and an error event."""
    for request in requests:
        await engine.prepare(request)


def generate(engine: Any, requests: Sequence[GenerationRequest]) -> AsyncIterator[Tagged]:
    """The events of `requests` (one, or several interleaved) tagged with their index. An engine that
    stops under the request (ModelNotReady: the server shuts down) failed the generation: it becomes
    `GenerationFailed`, since "not ready" answers belong to the moment before generation starts."""
    streams = [engine.generate(request) for request in requests]
    events = tagged(streams[0]) if len(streams) == 1 else cast(AsyncIterator[Tagged], merge_tagged(streams))
    return _stopped_is_failure(events)


async def _stopped_is_failure(events: AsyncIterator[Tagged]) -> AsyncIterator[Tagged]:
    try:
        async for item in events:
            yield item
    except ModelNotReady as exc:
        raise GenerationFailed(exc.message) from None
    finally:
        await events.aclose()  # type: ignore[attr-defined]
