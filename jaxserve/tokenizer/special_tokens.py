"""Which strings are a model's special tokens, resolved from its configs as transformers resolves them."""

from __future__ import annotations

import dataclasses
from typing import Any

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (the order of all_special_ids).
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
EXTRA_TOKEN_KEYS = ("additional_special_tokens", "extra_special_tokens")
# The defaults of the tokenizer classes whose pipelines backend.py reproduces, used for tokens no config names.
CLASS_DEFAULTS = {
    "LlamaTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "Qwen2Tokenizer": {"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
}


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """`named` maps attribute names (bos_token, eos_token, ...) to token strings, in NAMED_TOKENS order, with
    absent tokens left out; `extra` are the additional special tokens. These are the template variables
    (bos_token, eos_token, ...) and the tokens behind all_special_ids."""

    named: dict[str, str]
    extra: tuple[str, ...] = ()

    @property
    def bos(self) -> str | None:
        return self.named.get("bos_token")

    @property
    def eos(self) -> str | None:
        return self.named.get("eos_token")

    @property
    def all_tokens(self) -> tuple[str, ...]:
        """Named then extra tokens, each once (transformers' all_special_tokens)."""
        return tuple(dict.fromkeys([*self.named.values(), *self.extra]))


def resolve_special_tokens(config: dict[str, Any], special_tokens_map: dict[str, Any], tokenizer_class: str,
                           sentencepiece_extra: tuple[str, ...] = ()) -> SpecialTokens:
    """tokenizer_config.json names the tokens; special_tokens_map.json overrides it only when the config has no
    added_tokens_decoder (transformers' legacy path). The class's defaults fill tokens no config names (a token
    set to null stays absent)."""
    values = {key: config[key] for key in (*NAMED_TOKENS, *EXTRA_TOKEN_KEYS) if key in config}
    if "added_tokens_decoder" not in config:
        values.update({k: v for k, v in special_tokens_map.items() if k in (*NAMED_TOKENS, *EXTRA_TOKEN_KEYS)})
    values = {**CLASS_DEFAULTS.get(tokenizer_class, {}), **values}
    named = {key: token_text(values[key]) for key in NAMED_TOKENS if token_text(values.get(key)) is not None}
    return SpecialTokens(named=named, extra=(*sentencepiece_extra, *extra_tokens(values)))


def token_text(value: str | dict | None) -> str | None:
    """A token given as a string, an AddedToken dict ({"content": ...}) or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def extra_tokens(values: dict[str, Any]) -> list[str]:
    tokens: list[str] = []
    for key in EXTRA_TOKEN_KEYS:
        entry = values.get(key) or []
        items = entry.values() if isinstance(entry, dict) else entry
        tokens.extend(t for t in map(token_text, items) if t is not None)
    return tokens
