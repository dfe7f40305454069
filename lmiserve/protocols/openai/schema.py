"""OpenAI-compatible request bodies: chat completions (`ChatRequest`: the body TGI's /chat_tokenize
reads, `lmiserve.protocols.textgen.chat`, with OpenAI's and vLLM's sampling fields) and completions.

Unknown keys are accepted and ignored, each name logged once at WARNING (as vLLM does), and named with
the other ignored fields in the answer's `warnings` header (`ignored_fields`; lmiserve.protocols.openai.fields);
``"stop": null`` and ``"stream_options": null`` are accepted.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from lmiserve.core.errors import excerpt
from lmiserve.protocols.openai.fields import unknown_fields
from lmiserve.protocols.textgen.chat import ChatRequest as TextGenChatRequest
from lmiserve.protocols.textgen.chat import Message, SamplingFields, StreamOptions
from lmiserve.protocols.textgen.parameters import UINT32

__all__ = ["ChatRequest", "CompletionRequest", "Message", "StreamOptions"]

log = logging.getLogger(__name__)
_WARNED_MAX = 1000  # field names remembered (then each further unknown name is logged at DEBUG)


class OpenAISampling(BaseModel):
    """OpenAI's and vLLM's sampling fields beyond TGI's (meaning and ranges: `openai.sampling`), the
    unknown-field warning, and what the body held beyond the schema (`ignored_fields`)."""

    _warned: ClassVar[set[str]] = set()
    _unknown: list[str] = PrivateAttr(default_factory=list)  # openai.fields.unknown_fields of the body
    _stream_options_defined: bool = PrivateAttr(False)  # vLLM's test: a non-empty `stream_options` object

    top_k: int | None = None
    min_p: float | None = None
    logit_bias: dict[StrictStr, float] | None = None
    bad_words: list[StrictStr] | None = None
    skip_special_tokens: StrictBool = True
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    # vLLM's: the waiting queue admits lower values first; prefix-cache blocks are shared only with requests
    # of the same salt
    priority: StrictInt = Field(0, ge=-(2**31), le=2**31 - 1)
    # vLLM's: keep only the last N prompt tokens (-1: as many as the model takes)
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            for name in data:
                if not isinstance(name, str) or name in known or name[:200] in OpenAISampling._warned:
                    continue
                if len(OpenAISampling._warned) < _WARNED_MAX:
                    OpenAISampling._warned.add(name[:200])
                    log.warning("ignoring unknown request field %s (not supported by this server)", excerpt(name))
                else:
                    log.debug("ignoring unknown request field %s", excerpt(name))
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _note_unknown(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, OpenAISampling):
            model._unknown = unknown_fields(data, cls.model_fields)
            model._stream_options_defined = bool(data.get("stream_options"))
        return model

    @property
    def stream_options_defined(self) -> bool:
        """Whether `stream_options` was given as a non-empty object (vLLM refuses it without `stream`)."""
        return self._stream_options_defined

    @property
    def ignored_fields(self) -> list[str]:
        """The fields given a value that the server does nothing with (openai.fields): the unknown keys,
        in the body's order, then the known fields that are accepted and not used."""
        return self._unknown + (["user"] if self.user is not None else [])


class ChatRequest(TextGenChatRequest, OpenAISampling):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={"examples": [{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}]},
    )

    prompt_logprobs: int | None = Field(None, ge=0, le=UINT32)  # vLLM's (openai.scoring)
    # more variables for the chat template (vLLM's; e.g. {"enable_thinking": false}); `reasoning_effort`
    # reaches the template as a variable too (openai.parse)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: end the prompt with the assistant's turn opened (default), or leave the last (assistant)
    # message open so the answer continues it (not both)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    @property
    def ignored_fields(self) -> list[str]:
        """`OpenAISampling.ignored_fields`, and `top_logprobs` without `logprobs: true` (it counts only with it)."""
        unused_top = ["top_logprobs"] if self.top_logprobs and not self.logprobs else []
        return super().ignored_fields + unused_top


class CompletionRequest(SamplingFields, OpenAISampling):
    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"prompt": "The capital of France is", "max_tokens": 8}]}
    )

    # a string, strings, token ids, or token-id lists (openai.scoring)
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    suffix: Any = None
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0, le=UINT32)
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None  # vLLM accepts it on completions too
    prompt_logprobs: int | None = Field(None, ge=0, le=UINT32)  # vLLM's (openai.scoring)
