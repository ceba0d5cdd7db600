"""Incremental detokenization with stop strings.

Text is produced by the tokenizers library's DecodeStream, which buffers tokens until they form
valid UTF-8, so multi-byte characters split across tokens come out whole. While stop strings
are set, the last `len(longest stop) - 1` characters are held back so a stop string never leaks
into the streamed text before it is recognised and trimmed.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from streamer.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # `tokenizer` is a `tokenizers.Tokenizer` (the fast tokenizer's backend) or None for
        # token-ids-only use.
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=prompt_token_ids[-16:], skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.unflushed: list[int] = []  # tokens DecodeStream holds back (incomplete UTF-8 so far)
        self.skip_special = params.skip_special_tokens

    def append(self, token_id: int, check_stop: bool) -> str | None:
        """Add one token's text; return the stop string it completed, if any (text is trimmed)."""
        if self.tokenizer is None:
            return None
        chunk = self._step(token_id)
        self.unflushed.append(token_id)
        if not chunk:
            return None
        self.unflushed = []
        return self._add_text(chunk, check_stop)

    def _step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.tokenizer, token_id)
        except Exception as exc:  # tokenizers raises a bare Exception
            if "Invalid prefix" not in str(exc):
                raise
        # A byte-fallback tokenizer (Llama 2, Mistral, Gemma) decodes a byte token as its character
        # alone but as U+FFFD once an invalid byte follows it, so the text already streamed stops
        # being a prefix of the stream's decode. What was streamed stays; the stream starts afresh
        # (as vLLM's does) from the tokens it still held back.
        self.stream = DecodeStream(skip_special_tokens=self.skip_special)
        chunks = [self.stream.step(self.tokenizer, held) for held in [*self.unflushed, token_id]]
        return "".join(c for c in chunks if c) or None

    def flush(self, check_stop: bool) -> str | None:
        """At the end, bytes that never became valid UTF-8 come out as U+FFFD, as a full decode
        of the same tokens would show them. Text held back that way may complete a stop string:
        returned like `append`'s."""
        if not self.unflushed:  # (always so without a tokenizer)
            return None
        text = self.tokenizer.decode(self.unflushed, skip_special_tokens=self.skip_special)
        self.unflushed = []
        return self._add_text(text, check_stop)

    def _add_text(self, chunk: str, check_stop: bool) -> str | None:
        search_from = max(0, len(self.text) - self.hold)
        self.text += chunk
        if not (check_stop and self.stop):
            return None
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index + (len(stop) if self.include_stop else 0)]
        return stop

    def delta(self, finished: bool) -> str:
        """Text not handed out yet (all of it once finished, else minus the held-back tail)."""
        if finished:  # stop strings were checked when the sequence finished; an abort checks none
            self.flush(check_stop=False)
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
