"""Where a vision-language model's prompt text takes its images (docs/vision.md): duck-typed calls on the
model's processor (transformers' ProcessorMixin), shared by the protocols and the tensor model.

`placeholder` is what the processor's chat template writes for one image; `raw_prompt` puts a raw
prompt's images in place (KServe's and Vertex's ``text_input`` beside an ``image`` input). `encoder`
is the engine's encoder of the processor's prompts (engine/text/images.py's `ImageCodec.encode`,
registered with `register_encoder` when the engine's codec is made): a protocol counts a prompt's tokens
with it, so the processor runs once a request (the engine's own encoding of the prompt recalls it).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.media import Image

_PROBE = "lmiserve-probe-text"
_PLACEHOLDERS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

# a prompt with its images -> its token ids, each image's placeholder expanded (`InvalidRequest` when they
# do not fit)
ImageEncoder = Callable[[str, Sequence[Image]], list[int]]
# processor -> the engine's encoder of its prompts, both held weakly (the engine's codec holds the processor)
_ENCODERS: weakref.WeakKeyDictionary[Any, weakref.WeakMethod[ImageEncoder]] = weakref.WeakKeyDictionary()


def register_encoder(processor: Any, encode: ImageEncoder) -> None:
    """`encode` (a bound method: the engine's codec's) as the encoder of `processor`'s prompts with images,
    until its object is gone (the last registered wins)."""
    with contextlib.suppress(TypeError):  # a processor that takes no weak reference: none registered
        _ENCODERS[processor] = weakref.WeakMethod(encode)


def encoder(processor: Any) -> ImageEncoder | None:
    """The engine's encoder of `processor`'s prompts with images: what the engine runs (its processor
    output kept for the request's own encoding); None when no engine encodes them."""
    with contextlib.suppress(KeyError, TypeError):
        return _ENCODERS[processor]()
    return None


def placeholder(processor: Any) -> str:
    """What the processor's chat template writes for one image (``<image>``, Qwen2-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``, Gemma 3's ``<start_of_image>``, ...): a user turn
    with an image rendered against one with a probe text, what stands where the text stood; else the
    processor's `image_token`."""
    with contextlib.suppress(KeyError, TypeError):
        return _PLACEHOLDERS[processor]
    found = ""
    try:  # the template renders the user turn as prefix + content + suffix: an image's content is the answer
        with_image = _render(processor, [{"type": "image"}])
        with_text = _render(processor, [{"type": "text", "text": _PROBE}])
        at = with_text.find(_PROBE)
        prefix, suffix = with_text[:at], with_text[at + len(_PROBE) :]
        if at >= 0 and with_image.startswith(prefix) and with_image.endswith(suffix):
            found = with_image[len(prefix) : len(with_image) - len(suffix)].strip(" ")
    except Exception:  # noqa: BLE001 - a template that cannot render the probe: the processor's attribute
        found = ""
    if not found:
        found = str(getattr(processor, "image_token", "") or "<image>")
    with contextlib.suppress(TypeError):  # a processor that takes no weak reference: not remembered
        _PLACEHOLDERS[processor] = found
    return found


def _render(processor: Any, content: list[dict[str, Any]]) -> str:
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=False
    )
    return str(text)


def markers(processor: Any) -> tuple[str, ...]:
    """The texts that stand for an image in a raw prompt: `placeholder`, and the processor's own image
    token (and Gemma 3's begin-of-image token), which it expands."""
    found = [placeholder(processor)]
    for name in ("boi_token", "image_token"):
        value = getattr(processor, name, None)
        if isinstance(value, str) and value and value not in found:
            found.append(value)
    return tuple(found)


def raw_prompt(prompt: str, count: int, processor: Any) -> str:
    """A raw prompt with `count` images: as it is when it holds an image placeholder of the model (the
    processor matches them with the images), else the placeholders put first, one per image."""
    if not count:
        return prompt
    if processor is None:
        raise InvalidRequest("this model does not take images: it is not a vision-language model")
    if any(marker in prompt for marker in markers(processor)):
        return prompt
    return placeholder(processor) * count + prompt
