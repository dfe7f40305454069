"""A transformers tokenizer as the engine's `Tokenizer` (lmiserve.core.tokenizer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class HfTokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.hf = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        if not isinstance(text, str):  # only a batch of id lists decodes to a list
            raise TypeError(f"decode of one id list returned {type(text).__name__}")
        return text

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids or [])

    def __len__(self) -> int:
        return len(self.hf)
