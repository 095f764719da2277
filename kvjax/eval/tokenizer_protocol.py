"""What evaluation needs of a tokenizer (the bundled `models.tokenizer.Tokenizer` fits)."""

from typing import Protocol


class TextTokenizer(Protocol):
  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: list[int]) -> str: ...

  def apply_chat_template(
    self, messages: list[dict], add_generation_prompt: bool = True
  ) -> str: ...
