"""Prompts to token ids, checked against the model before any of it reaches the scheduler.

Kept apart from the engine loop so that callers can tokenize where it costs no one else anything:
AsyncEngine does it on its own thread, never on the engine's (a 1 MB prompt takes a tokenizer about
0.3 s, which would stall every stream), and a text that cannot fit is refused before tokenizing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt ready for `LLMEngine.add_request`: its token ids, and its text when it had one."""

    token_ids: list[int]
    text: str | None = None


class PromptProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len

    @cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: no text longer than max_model_len times this
        can fit (a byte-level entry spells one byte per character, and a character is at least a byte)."""
        return max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1

    def tokenize(self, prompt: str | list[int] | dict[str, Any] | TokenizedPrompt, room: int = 1) -> TokenizedPrompt:
        """Text, token ids, {"prompt": ...} or {"prompt_token_ids": ...}; ValueError when it is none of
        those, empty, outside the vocabulary or too long for the model with `room` tokens after it (1:
        one to generate; 0: an embedding, which generates none)."""
        if isinstance(prompt, TokenizedPrompt):
            return self._checked(prompt, room)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids'")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            if len(prompt) > (self.max_model_len - room) * self.max_token_chars:
                raise ValueError(f"prompt has {len(prompt)} characters: more than the model's "
                                 f"{self.max_model_len - room} prompt tokens can hold (at most "
                                 f"{self.max_token_chars} characters each)")
            return self._checked(TokenizedPrompt(self.tokenizer(prompt).input_ids, prompt), room)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return self._checked(TokenizedPrompt(list(prompt)), room)
        raise ValueError("prompt must be a string, a list of token ids, or {'prompt_token_ids': [...]}")

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> TokenizedPrompt:
        """The checkpoint's chat template with the generation prompt, and the function definitions
        `tools` where the template renders them (ValueError when it has no template)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return self._checked(TokenizedPrompt(self.tokenizer(text, add_special_tokens=False).input_ids))

    def token_ids(self, prompt: str | None, messages: list[dict[str, Any]] | None, tools: list[dict[str, Any]] | None,
                  add_special_tokens: bool, add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
        """A text's or a conversation's token ids, unchecked (AsyncEngine.tokenize)."""
        if messages is None:
            return list(self.tokenizer(prompt or "", add_special_tokens=add_special_tokens).input_ids)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def text(self, token_ids: list[int]) -> str:
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return self.tokenizer.decode(token_ids)

    def _checked(self, prompt: TokenizedPrompt, room: int = 1) -> TokenizedPrompt:
        if not prompt.token_ids:
            raise ValueError("prompt is empty")
        ids = prompt.token_ids
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt.token_ids) > self.max_model_len - room:
            left = ", one token left to generate" if room else ""
            raise ValueError(f"prompt has {len(prompt.token_ids)} tokens but the model allows at most "
                             f"{self.max_model_len - room} (max_model_len {self.max_model_len}{left})")
        return prompt
