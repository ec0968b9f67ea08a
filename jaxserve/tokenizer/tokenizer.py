"""The Tokenizer the server and engine use: one interface over tokenizer.json and sentencepiece tokenizer.model."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from jaxserve.tokenizer.backend import build_backend, transformers_class
from jaxserve.tokenizer.chat_template import ChatTemplates, compile_chat_templates
from jaxserve.tokenizer.files import TokenizerFiles, read_tokenizer_files
from jaxserve.tokenizer.sentencepiece_model import SentencePieceModel, read_sentencepiece_model
from jaxserve.tokenizer.special_tokens import SpecialTokens, resolve_special_tokens

# transformers' clean_up_tokenization: undoes the spaces a WordPiece tokenizer puts before punctuation.
CLEAN_UP_REPLACEMENTS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """Text ⇄ token ids, as `transformers.AutoTokenizer.from_pretrained(model_dir)` does them.

    Invariants: `encode(text)` equals transformers' `tokenizer(text)["input_ids"]` (BOS/EOS per the tokenizer.json
    post-processor, or per add_bos_token/add_eos_token for a sentencepiece-only directory); `decode` equals
    transformers' decode (note our default skip_special_tokens=True); `apply_chat_template` equals its
    `apply_chat_template(..., tokenize=False)`. `eos_token_ids` is the tokenizer's eos followed by
    generation_config.json's, each once. Nothing is mutated after load, so one instance may serve many threads.
    """

    backend: tokenizers.Tokenizer = dataclasses.field(repr=False)
    special_tokens: SpecialTokens
    vocab_size: int  # including added tokens (len(tokenizer) in transformers)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    unk_token_id: int | None
    all_special_ids: tuple[int, ...]
    # What decode(..., skip_special_tokens=True) drops: the backend's special added tokens, a wider set than
    # all_special_ids (e.g. Llama 3's reserved tokens).
    skipped_special_ids: frozenset[int]
    chat_templates: ChatTemplates = dataclasses.field(repr=False)
    clean_up_tokenization_spaces: bool

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates.templates)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry (e.g. "▁Hello", "Ġworld", "<0xE1>"), not its text. KeyError outside the
        vocabulary (a model's embedding may have more rows than its tokenizer has tokens)."""
        token = self.backend.id_to_token(int(token_id))
        if token is None:
            raise KeyError(f"token id {token_id} is not in the vocabulary ({self.vocab_size} tokens)")
        return token

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **extra: Any) -> str:
        """The prompt text. Raises NoChatTemplateError when the model has none, ChatTemplateError when the
        template rejects the messages (raise_exception's message as is) or fails on them."""
        return self.chat_templates.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                          documents=documents, extra=extra)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, documents: list[dict] | None = None, **extra: Any) -> list[int]:
        """The prompt ids, as transformers' apply_chat_template(tokenize=True): the template writes BOS itself,
        so the text is encoded without adding special tokens again."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, documents, **extra)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(model_dir: str | Path, *, chat_template: str | None = None,
                   model_type: str | None = None) -> Tokenizer:
    """Loads the tokenizer of a Hugging Face model directory (or a jaxserve checkpoint holding its files).

    `chat_template` (a .jinja file or template text) replaces the model's templates. `model_type` ("llama",
    "mistral", ...) stands in for config.json when the directory lacks it; transformers' choice of tokenizer
    class depends on it (see backend.py). FileNotFoundError names the files looked for.
    """
    files = read_tokenizer_files(model_dir, model_type=model_type, chat_template=chat_template)
    spm = read_sentencepiece(files)
    tokenizer_class = transformers_class(files)
    special = resolve_special_tokens(files.config, files.special_tokens_map, tokenizer_class,
                                     sentencepiece_extra=tuple(p for p, _ in spm.added_pieces) if spm else ())
    backend = build_backend(files, tokenizer_class, special, spm)
    return Tokenizer(
        backend=backend,
        special_tokens=special,
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        bos_token_id=token_id(backend, special.bos),
        eos_token_ids=eos_token_ids(backend, special, files.generation_config),
        pad_token_id=token_id(backend, special.named.get("pad_token")),
        unk_token_id=token_id(backend, special.named.get("unk_token")),
        all_special_ids=tuple(backend.token_to_id(t) for t in special.all_tokens),
        skipped_special_ids=frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special),
        chat_templates=compile_chat_templates(files.chat_templates, special.named),
        clean_up_tokenization_spaces=cleans_up_spaces(files, backend),
    )


def read_sentencepiece(files: TokenizerFiles) -> SentencePieceModel | None:
    return read_sentencepiece_model(files.sentencepiece_model) if files.is_sentencepiece else None


def token_id(backend: tokenizers.Tokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def eos_token_ids(backend: tokenizers.Tokenizer, special: SpecialTokens, generation_config: dict) -> tuple[int, ...]:
    generation_eos = generation_config.get("eos_token_id")
    if generation_eos is None:
        generation_eos = []
    elif isinstance(generation_eos, int):
        generation_eos = [generation_eos]
    ids = [token_id(backend, special.eos), *generation_eos]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def cleans_up_spaces(files: TokenizerFiles, backend: tokenizers.Tokenizer) -> bool:
    """transformers 5 ignores clean_up_tokenization_spaces for BPE models (it would delete real spaces before
    punctuation) unless the config insists with its long-named override."""
    if not files.config.get("clean_up_tokenization_spaces", False):
        return False
    insists = files.config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return insists or type(backend.model).__name__ != "BPE"


def clean_up_tokenization(text: str) -> str:
    for old, new in CLEAN_UP_REPLACEMENTS:
        text = text.replace(old, new)
    return text
