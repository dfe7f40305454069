"""OpenAI-compatible request bodies: chat completions (`ChatRequest`, shared with TGI's
/chat_tokenize and kept in `lmiserve.server.textgen.chat`) and completions.

Unknown keys are ignored; ``"stop": null`` and ``"stream_options": null`` are accepted.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, StrictBool, StrictStr

from lmiserve.server.textgen.chat import ChatRequest, Message, SamplingFields, StreamOptions
from lmiserve.server.textgen.parameters import UINT32

__all__ = ["ChatRequest", "CompletionRequest", "Message", "StreamOptions"]


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"prompt": "The capital of France is", "max_tokens": 8}]}
    )

    prompt: StrictStr | list[StrictStr]
    suffix: Any = None
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0, le=UINT32)
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None  # vLLM accepts it on completions too

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)
