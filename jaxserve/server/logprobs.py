"""Log-probabilities in the two OpenAI shapes.

    completions (legacy): {"tokens": [str], "token_logprobs": [float|None], "top_logprobs": [{str: float}|None],
                           "text_offset": [int]}
    chat:                 {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                           "bytes"}]}], "refusal": None}

A token's string is its UTF-8 text, or "bytes:\\xe2\\x80" when its bytes are only part of a character (OpenAI's
convention); chat entries also carry the exact bytes. text_offset is where each token starts in the choice's
text, counting each token's decoded characters (special tokens the text leaves out count 0). JSON has no -inf: an impossible token reports -9999.0.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Sequence

from jaxserve.outputs import TokenLogprob

IMPOSSIBLE_LOGPROB = -9999.0
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte pieces


class TokenText:
    """Token id -> the bytes it stands for and the string logprobs report. Memoised: the vocabulary is finite."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_decoder = _byte_level_decoder(tokenizer)
        self._added = {i: t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
        self._skipped = tokenizer.skipped_special_ids
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._token_bytes(token_id)
        return cached

    def text_of(self, token_id: int) -> str:
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def text_length(self, token_id: int, skip_special_tokens: bool) -> int:
        """Characters the token adds to the choice's text (0 for a special token the text leaves out)."""
        if skip_special_tokens and token_id in self._skipped:
            return 0
        return len(self.bytes_of(token_id).decode("utf-8", errors="replace"))

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        try:
            piece = self._tokenizer.id_to_token(token_id)
        except KeyError:  # a model row the tokenizer has no entry for
            return b""
        fallback = BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        return piece.replace("\u2581", " ").encode()


def _byte_level_decoder(tokenizer) -> dict[str, int] | None:
    """GPT-2's byte <-> printable-character table, when the tokenizer decodes byte-level BPE."""
    decoder = tokenizer.backend.decoder
    if decoder is None or b'"ByteLevel"' not in decoder.__getstate__():
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else IMPOSSIBLE_LOGPROB


# ---- completions (legacy) -----------------------------------------------------------------------------------
def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], text: TokenText,
                        start_offset: int, skip_special_tokens: bool) -> tuple[dict, int]:
    """One entry per token; `entries[i]` is None where nothing was scored (the prompt's first token). Returns the
    logprobs and the text offset after the last token (where the next chunk's tokens start)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = start_offset
    for token_id, entry in zip(token_ids, entries):
        out["tokens"].append(text.text_of(token_id))
        out["text_offset"].append(offset)
        offset += text.text_length(token_id, skip_special_tokens)
        out["token_logprobs"].append(None if entry is None else finite(entry.logprob))
        out["top_logprobs"].append(None if entry is None else _top_dict(entry, text))
    return out, offset


def _top_dict(entry: TokenLogprob, text: TokenText) -> dict[str, float]:
    top = {text.text_of(token_id): finite(lp) for token_id, lp in entry.top}
    top.setdefault(text.text_of(entry.token_id), finite(entry.logprob))
    return top


# ---- chat ---------------------------------------------------------------------------------------------------
def chat_logprobs(entries: Iterable[TokenLogprob], text: TokenText) -> dict:
    return {"content": [_chat_entry(entry, text) for entry in entries], "refusal": None}


def _chat_entry(entry: TokenLogprob, text: TokenText) -> dict:
    top = [_chat_token(token_id, lp, text) for token_id, lp in entry.top]
    return {**_chat_token(entry.token_id, entry.logprob, text), "top_logprobs": top}


def _chat_token(token_id: int, logprob: float, text: TokenText) -> dict:
    return {"token": text.text_of(token_id), "logprob": finite(logprob), "bytes": list(text.bytes_of(token_id))}
