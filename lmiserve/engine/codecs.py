"""The prompt codec and the grammar compiler of a loaded model (its tokenizer, its limits, a vision-language model's
processor): the engine's (engine/factory.py), and with `engine_process` the serving process's own
(engine/process/client.py)."""

from __future__ import annotations

from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.runner.vision import bidirectional_images, image_token_id, is_vision_model
from lmiserve.engine.text.grammar_compiler import GrammarCompiler
from lmiserve.engine.text.images import ImageCodec
from lmiserve.engine.text.tokenizer import HfTokenizer
from lmiserve.engine.text.validation import PromptCodec

__all__ = ["grammar_compiler", "image_codec", "prompt_codec", "text_codec"]


def prompt_codec(loaded: LoadedModel, max_input_len: int | None) -> tuple[PromptCodec, GrammarCompiler]:
    """The prompt codec and grammar compiler of `loaded`'s tokenizer."""
    codec = text_codec(loaded, max_input_len, image_codec(loaded))
    return codec, grammar_compiler(loaded, codec)


def grammar_compiler(loaded: LoadedModel, codec: PromptCodec) -> GrammarCompiler:
    """The grammar compiler of `loaded`'s tokenizer (its llguidance tokenizer built on the first grammar);
    the engine's, and with `engine_process` the serving process's own, which checks a request's grammar
    before its response starts (engine/process/client.py)."""
    return GrammarCompiler(loaded.tokenizer, vocab_size=codec.vocab_size, eos_token_ids=loaded.eos_token_ids)


def text_codec(loaded: LoadedModel, max_input_len: int | None, images: ImageCodec | None = None) -> PromptCodec:
    """The prompt codec of `loaded`'s tokenizer and limits (`images`: a vision-language model's processor);
    the engine's, and with `engine_process` the serving process's own (engine/process/client.py)."""
    return PromptCodec(
        HfTokenizer(loaded.tokenizer),
        eos_token_ids=loaded.eos_token_ids,
        max_context=loaded.max_context,
        max_input_len=max_input_len,
        vocab_size=getattr(loaded.model.config.get_text_config(), "vocab_size", None),
        images=images,
        name=loaded.name,
    )


def image_codec(loaded: LoadedModel) -> ImageCodec | None:
    """A vision-language model's processor as the prompt codec's (None: a text model, or a VLM loaded
    without its processor: its requests with images are refused)."""
    processor = getattr(loaded, "processor", None)
    if processor is None or not is_vision_model(loaded.model):
        return None
    return ImageCodec(processor, image_token_id(loaded.model), atomic=bidirectional_images(loaded.model))
