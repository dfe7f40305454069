"""Prompt tokenization and the per-request limits that need the tokenizer."""

from __future__ import annotations

import dataclasses

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.tokenizer import Tokenizer
from lmiserve.engine.text.images import ImageCodec


class PromptCodec:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: set[int],
        max_context: int,
        max_input_len: int | None = None,
        vocab_size: int | None = None,
        images: ImageCodec | None = None,
        name: str = "this model",
    ) -> None:
        """`images`: the processor of a vision-language model (None: a request with images is refused,
        naming the model, `name`)."""
        self.tokenizer = tokenizer
        self.images = images
        self.name = name
        self.vocab_size = vocab_size or len(tokenizer)
        self.eos_token_ids = set(eos_token_ids)
        self.special_token_ids = set(tokenizer.all_special_ids) | self.eos_token_ids
        self.max_context = max_context
        self.max_input_len = min(max_input_len or max_context, max_context)
        # a prompt longer than this has more than max_input_len tokens: refused before tokenizing it,
        # which for a body of many megabytes would hold the event loop for seconds (0: no such bound)
        self.max_prompt_chars = self.max_input_len * int(getattr(tokenizer, "max_token_chars", 0))

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids (special tokens left out), as it starts a text and as it follows a
        space (a byte-level BPE spells " word" with other tokens than "word")."""
        found: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = [i for i in self.tokenizer.encode(text) if i not in self.special_token_ids]
                if ids and ids not in found:
                    found.append(ids)
        return found

    def marker_ids(self, text: str) -> list[int]:
        """`text` as the ids a model generates for it: its encoding without what the tokenizer adds to
        every text (a BOS before it, or an EOS after it)."""
        ids, added = self.tokenizer.encode(text), self.tokenizer.encode("")
        if added and ids[: len(added)] == added:
            return ids[len(added) :]
        if added and ids[-len(added) :] == added:
            return ids[: -len(added)]
        return ids

    def tokenized(self, request: GenerationRequest) -> bool:
        """Whether `encode(request)` needs no tokenizing: its ids are given, or its validation counted
        its prompt in this request (and `encoded_params` has no bad words or thinking budget end to encode)."""
        if request.params.bad_words and not request.params.bad_words_ids:
            return False
        if _unencoded_thinking(request.params):
            return False
        if request.images:  # the processor expands the image placeholders: never the counted ids
            return False
        if request.prompt_ids is not None:
            return True
        recalls = getattr(self.tokenizer, "recalls", None)
        return bool(recalls is not None and recalls(request.prompt))

    def encoded_params(self, params: SamplingParams) -> SamplingParams:
        """`params` as the engine runs them (the request's are immutable: a variant): its bad words as
        token ids, its thinking budget's closing text as ids; `params` itself when nothing is to encode."""
        bad_words_ids, thinking = params.bad_words_ids, params.thinking
        if params.bad_words and not bad_words_ids:
            bad_words_ids = self.bad_words_ids(params.bad_words)
        if thinking is not None and _unencoded_thinking(params):
            thinking = dataclasses.replace(thinking, close_ids=tuple(self.marker_ids(thinking.close)))
        if bad_words_ids is params.bad_words_ids and thinking is params.thinking:
            return params
        return dataclasses.replace(params, bad_words_ids=bad_words_ids, thinking=thinking)

    def runnable(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with its `encoded_params` (the request itself when nothing is to encode)."""
        params = self.encoded_params(request.params)
        return request if params is request.params else dataclasses.replace(request, params=params)

    def encode_request(self, request: GenerationRequest) -> tuple[GenerationRequest, list[int]]:
        """All the tokenizing a request needs, in one go: its prompt ids (`encode`) and `runnable(request)`."""
        ids = self.encode(request)
        return self.runnable(request), ids

    def encode(self, request: GenerationRequest) -> list[int]:
        params = request.params
        bad = [i for i in params.stop_token_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad} are outside the vocabulary (0..{self.vocab_size - 1})")
        bad = [i for i in params.logit_bias if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"`logit_bias` token ids {sorted(bad)[:10]} are outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if request.images:
            return self._check(request, self._with_images(request))
        if request.prompt_ids is not None:
            return self._check(request, self._no_image_tokens(self._given_ids(request.prompt_ids)))
        if params.truncate is None and self.max_prompt_chars and len(request.prompt) > self.max_prompt_chars:
            raise InvalidRequest(
                f"Input prompt ({len(request.prompt)} characters: more than {self.max_input_len} tokens) is too "
                f"long and exceeds limit of {self.max_input_len}"
            )
        return self._check(request, self._no_image_tokens(self.tokenizer.encode(request.prompt)))

    def _no_image_tokens(self, ids: list[int]) -> list[int]:
        """`ids` of a prompt without images; `InvalidRequest` when a vision-language model's image token is
        among them (its image placeholder written as text: no image features would stand behind it)."""
        if self.images is not None and self.images.image_token_id in ids:
            shown = f" (`{self.images.placeholder}`)" if self.images.placeholder else ""
            raise InvalidRequest(
                f"the prompt holds the model's image token{shown} but no image: send images as image parts"
            )
        return ids

    def _with_images(self, request: GenerationRequest) -> list[int]:
        """The prompt's ids with its images' tokens (a `PromptIds` carrying its `ImageInputs`)."""
        if self.images is None:
            raise InvalidRequest(f"model `{self.name}` does not take images: it is not a vision-language model")
        if request.prompt_ids is not None:
            raise InvalidRequest("a prompt given as token ids cannot carry images")
        if request.params.truncate is not None:
            raise InvalidRequest("`truncate` cannot cut a prompt with images")
        return self.images.encode(request.prompt, request.images)

    def _given_ids(self, ids: list[int]) -> list[int]:
        """A prompt given as token ids, used as they are; `InvalidRequest` for one outside the vocabulary."""
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequest(f"Token id {bad[0]} is out of vocabulary (0..{self.vocab_size - 1})")
        return list(ids)

    def _check(self, request: GenerationRequest, ids: list[int]) -> list[int]:
        """`ids` truncated as asked and checked against the limits."""
        params = request.params
        if params.truncate is not None and len(ids) > params.truncate:
            ids = ids[-params.truncate :]
        if not ids:
            raise InvalidRequest("The prompt is empty after tokenization")
        if len(ids) > self.max_input_len:
            raise InvalidRequest(
                f"Input prompt ({len(ids)} tokens) is too long and exceeds limit of {self.max_input_len}"
            )
        if len(ids) + params.max_new_tokens > self.max_context:
            raise InvalidRequest(
                f"Input prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the model's context length of {self.max_context} tokens"
            )
        return ids


def _unencoded_thinking(params: SamplingParams) -> bool:
    """A thinking budget whose closing text is not yet token ids."""
    return params.thinking is not None and bool(params.thinking.close) and not params.thinking.close_ids
