"""LMI requests answered as one JSON document each, whatever `stream` and the server's
output_formatter say: how an LLM answers the lines of a SageMaker JSON Lines body (the dispatcher
hands this module to the SageMaker handler).

`parse_line` validates (InvalidRequest with LMI's message); `answer_line` generates and returns LMI's
`json` body as an object (GenerationFailed when the generation fails).
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

from lmiserve.models.service import ModelService
from lmiserve.protocols.lmi import parse as lmi
from lmiserve.protocols.lmi.formatters import get_formatter
from lmiserve.server.pipeline import failure_of, is_error_finish


def parse_line(service: ModelService, payload: Any) -> lmi.LmiCall:
    if isinstance(payload, dict):
        payload = {k: v for k, v in payload.items() if k != "stream"}
    return lmi.parse(payload, service.limits, names=lmi.model_names(service), adapters=service.adapters)


async def answer_line(service: ModelService, call: lmi.LmiCall) -> Any:
    encoder = get_formatter("json", call.options)
    async with aclosing(service.ready_generator().generate(call.requests[0])) as events:  # closing aborts it
        async for event in events:
            if is_error_finish(event):
                raise failure_of(event)
            encoder.on_event(0, event)
    return json.loads(encoder.close())
