"""Incremental detokenization: the text each batch of generated tokens adds, safe to stream."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxserve.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"
# Prompt tokens decoded in front of the first generated one, so that its leading space is decoded the way it is
# after the prompt (a sentencepiece decoder strips the leading space of the first piece it is given).
CONTEXT_TOKENS = 6
# How far back from the end of the prompt to look for them (special tokens may be skipped).
PROMPT_SCAN_TOKENS = 4 * CONTEXT_TOKENS
# A UTF-8 character has at most 4 bytes and every token carries at least one byte, so at most the last 3 tokens
# can hold the beginning of a character that is not finished yet.
MAX_UNFINISHED_TOKENS = 3


class IncrementalDetokenizer:
    """Streams the text of one request's generated tokens: `add(new_ids)` returns the text they add.

        window:  [ context: ids already read (emitted, or the prompt) | ids not read yet ]
                                                        read_offset ─┘
    Each step decodes the context alone and the whole window, and emits the difference, so every token is decoded
    after at least one token before it and together with the bytes that complete its character. After emitting,
    the newly read ids become the context and older ids are dropped: the work per token is bounded by the window
    and does not grow with the output.

    Invariants:
      (a) no delta from add() ends inside a character: while the window's text ends in U+FFFD made by its last
          ≤3 tokens (byte-fallback pieces like <0xE1>, byte-level BPE fragments), those tokens stay unread until
          the character completes. flush() at the end of the stream emits whatever is held.
      (b) "".join(all deltas) == decode(prompt_ids + generated)[len(decode(prompt_ids)):]: the text the generation
          adds after its prompt. With no prompt that is decode(generated) exactly; after a prompt it differs from
          decode(generated) only in that a sentencepiece model's first generated piece keeps its leading space
          ("▁Paris" after "The capital is" streams " Paris"), as vLLM and TGI stream it. A prompt ending inside a
          character counts only up to that character, which the generation completes and streams.
      Skipped special tokens (skip_special_tokens=True) are dropped before they enter the window, as decode drops
      them before decoding. Known divergence, on invalid model output only: decode() turns a run of byte-fallback
      pieces that is not valid UTF-8 into one U+FFFD per byte, even the valid characters at its start, which
      the stream may already have emitted.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        tail = self._visible(prompt_ids[-PROMPT_SCAN_TOKENS:])[-CONTEXT_TOKENS:]
        self._window, self._read_offset = self._prompt_context(tail)
        self._deltas: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._deltas)

    def add(self, new_ids: Iterable[int]) -> str:
        """The text that `new_ids` finish; "" while a character is unfinished."""
        self._window.extend(self._visible(new_ids))
        return self._emit_through(*self._finished_end())

    def flush(self) -> str:
        """The held-back text, unfinished characters included (as U+FFFD, like decode); call at end of stream."""
        return self._emit_through(len(self._window), self._decode(self._window))

    def _visible(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if not self._skip_special_tokens:
            return ids
        return [i for i in ids if i not in self._tokenizer.skipped_special_ids]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, tail: list[int]) -> tuple[list[int], int]:
        """The prompt tokens decoded in front of the generated ones, and how many of them count as read.

        The context starts at a character: a token continuing a character begun before it decodes as U+FFFD (and
        would spoil a whole byte-fallback run). The read part ends at a character: the bytes of a character the
        prompt leaves unfinished are completed, and streamed, by the generation."""
        for start in range(len(tail)):
            for held in range(min(MAX_UNFINISHED_TOKENS, len(tail) - start) + 1):
                text = self._decode(tail[start:len(tail) - held])
                if not text.startswith(REPLACEMENT_CHARACTER) and not text.endswith(REPLACEMENT_CHARACTER):
                    return tail[start:], len(tail) - start - held
        return [], 0

    def _finished_end(self) -> tuple[int, str | None]:
        """The longest window whose text does not end in an unfinished character, and that text; (read_offset,
        None) when there is none yet. A U+FFFD that dropping the last 3 tokens does not remove is invalid bytes,
        not an unfinished character, and is emitted."""
        end = len(self._window)
        for held in range(MAX_UNFINISHED_TOKENS + 1):
            if end - held <= self._read_offset:
                return self._read_offset, None
            text = self._decode(self._window[:end - held])
            if not text.endswith(REPLACEMENT_CHARACTER):
                return end - held, text
        return end, self._decode(self._window)

    def _emit_through(self, end: int, text: str | None) -> str:
        if end <= self._read_offset or text is None:
            return ""
        context = self._decode(self._window[:self._read_offset])
        delta = text[common_prefix_length(context, text):]
        if not delta:  # e.g. a lone "▁": keep it unread so its space is decoded with the next piece
            return ""
        self._deltas.append(delta)
        del self._window[:self._read_offset]
        self._read_offset = end - self._read_offset
        return delta


def common_prefix_length(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
