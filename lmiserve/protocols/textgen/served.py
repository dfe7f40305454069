"""The default LLM seen as a text generator: its engine, limits, token counting, chat template and
the values TGI reports about it (compute type, system fingerprint)."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from lmiserve import __version__
from lmiserve.core import image_prompt
from lmiserve.core.adapters import Source, select_adapter
from lmiserve.core.engine import TextGenerator
from lmiserve.core.errors import InvalidRequest, LmiServeError, TemplateError
from lmiserve.core.limits import TextGenLimits, limits_for
from lmiserve.core.media import Image, ImageSource
from lmiserve.core.tokenizer import remember_encoding
from lmiserve.models.bundled import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME
from lmiserve.models.service import ModelService
from lmiserve.protocols.textgen import images as vision
from lmiserve.protocols.textgen.tools.parsers import ToolParser, for_tokenizer
from lmiserve.protocols.textgen.tools.spec import ToolSpec
from lmiserve.server.lookup import default_llm

if TYPE_CHECKING:
    from lmiserve.engine.lora.registry import Adapters

TGI_CLIENT_NAMES = ("tgi", "dummy")  # the `model` TGI's clients send to a TGI endpoint


@dataclass
class Served:
    """The default model, ready."""

    service: ModelService
    engine: TextGenerator
    limits: TextGenLimits
    tokenizer: Any
    started: float = field(default_factory=time.monotonic)
    # a vision-language model's processor (its chat template, its image placeholders); None: a text model
    processor: Any = None

    @classmethod
    def of(cls, service: ModelService) -> Served:
        """`service` as a text generator; raises ModelNotReady while it loads or after it failed."""
        engine = service.ready_generator()
        llm = service.ready_llm()
        return cls(service, engine, limits_for(service), llm.tokenizer, processor=getattr(llm, "processor", None))

    def names(self) -> tuple[str, ...]:
        """The names a request's `model` may give this model: its own, `served_model_name`'s aliases, the
        bundled model's other names when it is the bundled model, and the fixed names TGI's clients send
        (``tgi``; ``dummy``: huggingface_hub's InferenceClient given a URL)."""
        aliases = [a.strip() for a in (self.service.settings.served_model_name or "").split(",") if a.strip()]
        bundled = DEFAULT_MODEL_ALIASES if self.service.name == DEFAULT_MODEL_NAME else ()
        return (self.service.name, *aliases, *bundled, *TGI_CLIENT_NAMES)

    def accepts(self, name: str | None) -> bool:
        """Whether `name` (a request's `model`; None or empty: not given) names this model."""
        names = self.names()
        return not name or name in names or "*" in names

    @property
    def adapters(self) -> Adapters | None:
        """The model's LoRA adapters (None: served without `enable_lora`)."""
        return self.service.adapters

    def adapter(self, *sources: Source) -> str | None:
        """The LoRA adapter a request's adapter fields (TGI's `adapter_id`, ...; highest precedence first)
        select: None for the base model (no name, or a name of this model), else a registered adapter's
        name; `AdapterNotFound` for another name (`select_adapter`)."""
        return select_adapter(sources, self.adapters, self._own())

    def model_adapter(self, *sources: Source, not_found: Callable[[str], LmiServeError]) -> str | None:
        """The LoRA adapter a request's `model` (OpenAI's, Anthropic's; `sources`: where the request names
        it, highest precedence first) selects, as vLLM reads it: None when it names this model (or is not
        given), the adapter's name when it names a registered adapter of this model (the model's own names
        win); `not_found(name)` is raised for any other name."""

        def other(name: str) -> str | None:
            if not self.accepts(name):
                raise not_found(name)
            return None  # a wildcard served name (`*`): the base model

        return select_adapter(sources, self.adapters, self._own(), other=other)

    def _own(self) -> list[str]:
        return [n for n in self.names() if n != "*"]

    @property
    def takes_images(self) -> bool:
        return self.processor is not None

    async def load_images(self, sources: list[ImageSource]) -> tuple[Image, ...]:
        """A request's images, fetched and decoded (`vision.load`: 400 naming the model when it takes none)."""
        return await vision.load(self.service.settings, self.service.name, self.takes_images, sources)

    def counter(self, images: tuple[Image, ...]) -> Callable[[str], int]:
        """`count_tokens`, or with `images` the length of the prompt the processor expands (each image's
        placeholder as the image tokens it becomes)."""
        if not images:
            return self.count_tokens
        return lambda text: len(self.encode_with_images(text, images))

    def encode_with_images(self, text: str, images: tuple[Image, ...], *, special: bool = True) -> list[int]:
        """The prompt's ids with its images' tokens, as the processor makes them (`special`: special tokens
        added, as the engine encodes); `InvalidRequest` when the text's placeholders do not match the images.
        With special tokens, the engine's encoder's (`image_prompt.encoder`, when the engine has one): the
        engine's encoding of the same prompt in this request reuses its output (the processor runs once)."""
        processor = self.processor
        if processor is None:
            raise vision.no_vision(self.service.name)
        encode = image_prompt.encoder(processor) if special else None
        if encode is not None:
            return list(encode(text, images))
        pixels = [[image.pixels for image in images]]  # one prompt's images (as the engine's ImageCodec)
        try:
            out = processor(text=[text], images=pixels, add_special_tokens=special, return_tensors="np")
        except (ValueError, TypeError, IndexError) as exc:  # placeholders and images disagree, and the like
            raise InvalidRequest(f"the images do not fit the prompt: {str(exc)[:300]}") from None
        return [int(i) for i in out["input_ids"][0].tolist()]

    def image_prompt(self, text: str) -> str:
        """A raw prompt's image marks (TGI's markdown images in `inputs`) as the placeholder the model's
        chat template writes for an image; `text` itself when it has none."""
        if vision.MARK not in text:
            return text
        if self.processor is None:
            raise vision.no_vision(self.service.name)
        return text.replace(vision.MARK, vision.placeholder(self.processor))

    def count_tokens(self, text: str) -> int:
        """Prompt length as the engine will see it (special tokens added); the ids are kept for the
        engine's encoding of the same text in this request (tokenized once)."""
        ids = list(self.tokenizer(text)["input_ids"])
        remember_encoding(self.tokenizer, text, ids)
        return len(ids)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (its config's, else the tokenizer's), as the engine checks ids."""
        config = getattr(self.service.ready_llm().model, "config", None)
        return int(getattr(config, "vocab_size", None) or len(self.tokenizer))

    def decode(self, ids: list[int]) -> str:
        """A prompt given as token ids, as text (special tokens left out) to echo; `InvalidRequest` for
        an id outside the vocabulary (the engine's message: its check stands, this one comes first)."""
        size = self.vocab_size
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise InvalidRequest(f"Token id {bad[0]} is out of vocabulary (0..{size - 1})")
        return str(self.tokenizer.decode([i for i in ids if i < len(self.tokenizer)], skip_special_tokens=True))

    @property
    def tool_parser(self) -> ToolParser:
        """How the model writes tool calls (the `tool_call_parser` setting; `auto`: from its chat template)."""
        return for_tokenizer(self.service.settings.tool_call_parser, self.tokenizer, self.service.name)

    def check_tools(self, tools: ToolSpec | None) -> None:
        """`InvalidRequest` for ``tool_choice: "auto"`` when the server was started with
        `enable_auto_tool_choice` false (vLLM refuses it without its flag)."""
        if tools is not None and tools.mode == "auto" and not self.service.settings.enable_auto_tool_choice:
            raise InvalidRequest(
                '"auto" tool choice is off on this server (enable_auto_tool_choice=false): '
                'use "required", "none" or a named function'
            )

    def special_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        for_engine: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The chat template applied (generation prompt added, `tools` given to it when not None);
        `TemplateError` when the model has none or it fails. `for_engine`: without a leading BOS when
        the tokenizer adds one itself (the engine tokenizes with special tokens), so it appears once.
        `template_kwargs`: more template variables (OpenAI's `chat_template_kwargs`); `InvalidRequest`
        when one names an argument of the template call itself (``tokenize``, ``tools``, ...).
        `add_generation_prompt`, `continue_final_message`: vLLM's chat fields, as transformers means them."""
        processor = self.processor
        if processor is None and vision.has_marks(messages):
            raise vision.no_vision(self.service.name)
        templater = processor if processor is not None and getattr(processor, "chat_template", None) else None
        if templater is not None:  # a vision model: its processor's template, content as parts
            messages = vision.template_messages(messages)
        else:
            templater = self.tokenizer
        if not getattr(templater, "chat_template", None):
            raise TemplateError("template not found")
        extra: dict[str, Any] = dict(template_kwargs or {})
        taken = extra and sorted(set(extra) & {*inspect.signature(self.tokenizer.apply_chat_template).parameters})
        if taken:
            names = ", ".join(taken)
            raise InvalidRequest(f"chat_template_kwargs may not set {names}: give them as fields, if at all.")
        if tools is not None:
            extra["tools"] = tools
        try:
            if continue_final_message:  # transformers' flag; passed only when set (older templates lack it)
                extra["continue_final_message"] = True
            text = templater.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as exc:  # noqa: BLE001 - jinja errors of a model's own template
            raise TemplateError(str(exc)) from None
        bos = getattr(self.tokenizer, "bos_token", None)
        if for_engine and bos and text.startswith(bos) and self._adds_bos():
            text = text[len(bos) :]
        return text

    def _adds_bos(self) -> bool:
        ids = self.tokenizer("a")["input_ids"]
        return bool(ids) and ids[0] == getattr(self.tokenizer, "bos_token_id", None)

    @property
    def compute_type(self) -> str:
        """``x-compute-type``: env COMPUTE_TYPE, else from the device (TGI's default is gpu+optimized)."""
        default = "cpu" if self.service.ready_llm().device.type == "cpu" else "gpu+optimized"
        return os.environ.get("COMPUTE_TYPE", default)

    @property
    def system_fingerprint(self) -> str:
        return f"{__version__}-{os.environ.get('DOCKER_LABEL') or 'native'}"


def served(request: Request) -> Served:
    """The ready default LLM; ModelNotReady while it loads or after it failed, ModelRequired when the
    server has no single LLM."""
    return Served.of(default_llm(request))


def ready_llm(request: Request) -> ModelService | None:
    """The default LLM when there is exactly one and it is ready, else None (never raises: for health
    checks)."""
    llms = [service for service in request.app.state.registry if service.is_llm]
    if len(llms) == 1 and llms[0].status == ModelService.READY:
        return llms[0]
    return None
