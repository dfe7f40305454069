"""OpenAI-compatible request models (reference tgi-openai.md §6): chat completions and completions.

Unknown keys are ignored; ``"stop": null`` and ``"stream_options": null`` are accepted (§15).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from lmiserve.protocols.tgi.schema import UINT32, UINT64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """Content as text; image parts become ``![](url)`` as in TGI."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif part.get("type") == "image_url":
                parts.append(f"![]({(part.get('image_url') or {}).get('url', '')})")
        return "".join(parts)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = Field(None, ge=0, le=UINT32)
    seed: int | None = Field(None, ge=0, le=UINT64)
    stop: list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(None, ge=1, le=UINT32)
    # vLLM's extensions, which benchmark clients send to force an exact number of tokens
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0, le=UINT32)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value):
        return [value] if isinstance(value, str) else value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, le=UINT32)
    presence_penalty: float | None = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=UINT32)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr]
    suffix: Any = None
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0, le=UINT32)
    presence_penalty: float | None = None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)
