"""The chat request body: POST /v1/chat/completions reads it, and so does TGI's /chat_tokenize
(which applies the chat template to its messages). The fields shared with OpenAI's completions
request are `SamplingFields`.

Unknown keys are ignored; ``"stop": null`` and ``"stream_options": null`` are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from lmiserve.core.media import ImageSource
from lmiserve.protocols.textgen import images
from lmiserve.protocols.textgen.parameters import UINT32, UINT64

IMAGE_PARTS = ("image_url",)  # OpenAI's image content part


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made (content null)
    tool_call_id: str | None = None  # role "tool": the call this is the result of

    def text(self) -> str:
        """Content as text; an image part is an image's mark (`images.MARK`: a vision model's template
        gets an image there; `image_sources` gives the images in the same order)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif part.get("type") in IMAGE_PARTS:
                parts.append(images.MARK)
        return "".join(parts)

    def image_sources(self, where: str) -> list[ImageSource]:
        """The image parts' sources, in order: OpenAI's ``{"type": "image_url", "image_url": {"url": ...,
        "detail"?: ...}}`` (or the URL as a string, as vLLM takes it); `InvalidRequest` naming `where`."""
        if not isinstance(self.content, list):
            return []
        sources = []
        for j, part in enumerate(self.content):
            if part.get("type") not in IMAGE_PARTS:
                continue
            at = f"{where}.content[{j}].image_url"
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            sources.append(images.url_source(url, at))
        return sources


class SamplingFields(BaseModel):
    """The fields chat and completion requests share (validated in this order, before their own)."""

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
    # vLLM's stop extensions (OpenAI's routes: the stop string is left out of the text unless asked)
    include_stop_str_in_output: StrictBool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=UINT32)]] | None = None
    # vLLM's extensions, which benchmark clients send to force an exact number of tokens
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0, le=UINT32)
    # vLLM's structured-output extensions (lmiserve.core.constraints reads them)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(SamplingFields):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={"examples": [{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}]},
    )

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, le=UINT32)
    presence_penalty: float | None = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=UINT32)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    tool_prompt: str | None = None  # TGI: replaces the default answer-format instruction
    response_format: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def image_sources(self) -> list[ImageSource]:
        """Every message's image parts' sources, in the order their marks appear in the messages."""
        return [s for i, m in enumerate(self.messages) for s in m.image_sources(f"messages[{i}]")]
