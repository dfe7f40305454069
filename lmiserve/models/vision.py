"""Vision-language models: telling one from a text model, and building its processor without torchvision.

A VLM directory (LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Idefics3/SmolVLM, Gemma 3, ...) holds a
config with a ``vision_config`` and a processor: an image processor, the tokenizer and the processor class
that expands each image placeholder into the image's tokens. The image processor is always built on the
PIL backend (transformers' ``*ImageProcessorPil``), never the torchvision one: torchvision is optional,
and a CPU install may have a torchvision that does not import beside its torch. Processors that also take
a video processor (the Qwen-VL family's) are built without it, since transformers' video processors need
torchvision: such a model serves images, not videos.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lmiserve.models.errors import ModelLoadError

__all__ = ["is_vision_config", "load_processor"]

logger = logging.getLogger(__name__)

# What a CPU install needs for a VLM's processor (docs/vision.md says the same).
_INSTALL_HINT = (
    "vision-language models need Pillow (pip install pillow); transformers' PIL image processors need no "
    "torchvision, and a family whose processor has no PIL image processor needs a torchvision build "
    "matching the installed torch (pip install torchvision from the index torch came from)"
)


def is_vision_config(config: Any) -> bool:
    """Whether `config` (a transformers config) is a vision-language model's: it has a vision tower
    (``vision_config``) or its class is one of AutoModelForImageTextToText's."""
    if getattr(config, "vision_config", None) is not None:
        return True
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    try:
        return type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    except (KeyError, ImportError, AttributeError):  # a remote-code config the mapping cannot resolve
        return False


def load_processor(path: Path, config: Any, trust_remote_code: bool = False) -> Any:
    """The processor of the VLM in the local directory `path` (never downloads), on the PIL image backend.
    Raises ModelLoadError when it cannot be built."""
    common: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    processor_class = _processor_class(path, config)
    try:
        if processor_class is not None:
            return _without_video(processor_class).from_pretrained(path, backend="pil", **common)
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path, backend="pil", **common)
    except ImportError as exc:
        raise ModelLoadError(f"could not build the processor of {path}: {exc}; {_INSTALL_HINT}") from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"could not build the processor of {path}: {exc}") from exc


def _processor_class(path: Path, config: Any) -> type[Any] | None:
    """The processor class the directory names (processor_config.json, else preprocessor_config.json, else
    tokenizer_config.json), else the one transformers maps the config's model type to; None when neither
    is a class transformers has (a remote-code processor)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    names: list[str] = []
    for filename in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        try:
            value = json.loads((path / filename).read_text(encoding="utf-8")).get("processor_class")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, str):
            names.append(value)
    mapped = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    if isinstance(mapped, str):
        names.append(mapped)
    for name in names:
        cls = processor_class_from_name(name)
        if isinstance(cls, type) and hasattr(cls, "get_attributes"):
            return cls
    return None


def _without_video(processor_class: type[Any]) -> type[Any]:
    """`processor_class` itself, or, when it takes a video processor (which needs torchvision), a subclass
    of the same name whose processor is built from its image processor and tokenizer alone."""
    attributes = processor_class.get_attributes()  # a ProcessorMixin
    if "video_processor" not in attributes:
        return processor_class
    if set(attributes) != {"image_processor", "tokenizer", "video_processor"}:
        return processor_class  # another layout: left to transformers (and to torchvision)
    cached = _IMAGES_ONLY.get(processor_class)
    if cached is None:
        cached = _IMAGES_ONLY[processor_class] = _images_only_subclass(processor_class)
    return cached


# processor class -> its subclass without the video processor (one class each, so isinstance holds)
_IMAGES_ONLY: dict[type[Any], type[Any]] = {}


def _images_only_subclass(processor_class: type[Any]) -> type[Any]:
    parent_init = processor_class.__init__

    def __init__(
        self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
    ) -> None:
        kwargs.pop("video_processor", None)
        # ProcessorMixin pairs positional sub-processors with this class's attributes (the two above), so
        # the video processor's None is dropped rather than checked against torchvision's classes
        parent_init(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    logger.debug("%s: built without its video processor (images only)", processor_class.__name__)
    return type(
        processor_class.__name__,
        (processor_class,),
        {"__init__": __init__, "__module__": processor_class.__module__, "__doc__": processor_class.__doc__},
    )
