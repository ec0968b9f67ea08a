"""Builds the `tokenizers.Tokenizer` that encodes exactly as transformers 5's AutoTokenizer does for a directory.

transformers does not always run tokenizer.json as written. AutoTokenizer picks a class from tokenizer_config.json's
tokenizer_class and config.json's model_type (`transformers_class` below, reduced to the families we serve, and
assuming mistral_common is not installed), and some classes keep only tokenizer.json's vocabulary, merges, added
tokens and post-processor, and rebuild the rest:

    class            normalizer   pre-tokenizer                               decoder
    LlamaTokenizer   none         Metaspace("▁", prepend "first", or          "▁"→" ", byte fallback, fuse,
                                  "always" if "legacy": true)                  strip one leading space
    Qwen2Tokenizer   NFC          Qwen2's split regex, then ByteLevel         ByteLevel
    GemmaTokenizer   " "→"▁"      split on " ", merged with the previous      "▁"→" ", byte fallback, fuse
    anything else    tokenizer.json as written

A directory with only a sentencepiece tokenizer.model becomes a LlamaTokenizer built from its pieces. One deliberate
difference there: without "add_bos_token" in tokenizer_config.json transformers 5 adds no BOS; we add it, as
LlamaTokenizer always did and Llama/Mistral models need. With a tokenizer.json, BOS/EOS come from its
post-processor alone (transformers ignores add_bos_token/add_eos_token then).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from jaxserve.tokenizer.files import TokenizerFiles
from jaxserve.tokenizer.sentencepiece_model import SentencePieceModel
from jaxserve.tokenizer.special_tokens import SpecialTokens

LLAMA = "LlamaTokenizer"
QWEN2 = "Qwen2Tokenizer"
GEMMA = "GemmaTokenizer"
AS_WRITTEN = "TokenizersBackend"
# transformers' TOKENIZER_MAPPING_NAMES for the model types we serve (None: no class of its own).
MODEL_TYPE_CLASSES = {"llama": None, "mistral": AS_WRITTEN, "mixtral": AS_WRITTEN, "qwen2": QWEN2,
                      "qwen2_moe": QWEN2, "qwen3": QWEN2, "qwen3_moe": QWEN2, "gemma2": GEMMA, "gemma3": GEMMA,
                      "gemma3_text": GEMMA, "phi3": AS_WRITTEN}
# Model types whose tokenizer_config.json class transformers overrides with its own (part of
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS).
OVERRIDDEN_CLASS_MODEL_TYPES = ("qwen2", "phi3")
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizer", "PythonBackend", "MistralCommonBackend", "")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
METASPACE = "▁"


def transformers_class(files: TokenizerFiles) -> str:
    """The tokenizer class AutoTokenizer instantiates for this directory (models/auto/tokenization_auto.py)."""
    if files.is_sentencepiece:
        return LLAMA
    declared = (files.config.get("tokenizer_class") or "").removesuffix("Fast")
    registered = (MODEL_TYPE_CLASSES.get(files.model_type) or "").removesuffix("Fast")
    byte_level = '"ByteLevel"' in files.tokenizer_json
    if declared == LLAMA and byte_level and files.model_type not in OVERRIDDEN_CLASS_MODEL_TYPES:
        chosen = AS_WRITTEN  # a Llama-3-style byte-level tokenizer.json mislabelled LlamaTokenizer
    elif declared and registered and declared != registered:
        chosen = registered if files.model_type in OVERRIDDEN_CLASS_MODEL_TYPES else declared
        chosen = AS_WRITTEN if registered in GENERIC_CLASSES else chosen
    else:
        chosen = declared or registered
    return AS_WRITTEN if chosen in GENERIC_CLASSES else chosen


def build_backend(files: TokenizerFiles, tokenizer_class: str, special: SpecialTokens,
                  spm: SentencePieceModel | None) -> Tokenizer:
    """The backend tokenizer, with every special token of `special` registered as a special added token.
    `spm` is the parsed tokenizer.model when that is the vocabulary. The result is configured once here and
    never mutated afterwards (safe to share between threads)."""
    if spm is not None:
        backend = sentencepiece_backend(spm)
    else:
        backend = Tokenizer.from_str(files.tokenizer_json)
    CLASS_PIPELINES.get(tokenizer_class, keep_pipeline)(backend, files.config)
    register_added_tokens(backend, files.config.get("added_tokens_decoder") or {}, special)
    if spm is not None:
        backend.post_processor = bos_eos_processor(backend, files.config, special)
    backend.no_padding()
    backend.no_truncation()
    backend.encode_special_tokens = bool(files.config.get("split_special_tokens", False))
    return backend


def set_llama_pipeline(backend: Tokenizer, config: dict[str, Any]) -> None:
    """LlamaTokenizer's pipeline; the decoder drops the space the pre-tokenizer prepended."""
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = ("always" if config.get("legacy", False) else "first") if add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)


def set_qwen2_pipeline(backend: Tokenizer, config: dict[str, Any]) -> None:
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space") or False), use_regex=False)])
    backend.decoder = decoders.ByteLevel()


def set_gemma_pipeline(backend: Tokenizer, config: dict[str, Any]) -> None:
    """GemmaTokenizer's: spaces become "▁" (no prefix space); the BPE model keeps its byte fallback."""
    backend.normalizer = normalizers.Replace(" ", METASPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()])


def keep_pipeline(backend: Tokenizer, config: dict[str, Any]) -> None:
    """tokenizer.json as written."""


CLASS_PIPELINES = {LLAMA: set_llama_pipeline, QWEN2: set_qwen2_pipeline, GEMMA: set_gemma_pipeline}


def sentencepiece_backend(spm: SentencePieceModel) -> Tokenizer:
    backend = Tokenizer(models.BPE(vocab=spm.vocab, merges=spm.merges, fuse_unk=True, byte_fallback=True,
                                   dropout=None))
    backend.add_tokens([AddedToken(piece, special=special, normalized=False) for piece, special in spm.added_pieces])
    return backend


def register_added_tokens(backend: Tokenizer, added_tokens_decoder: dict[str, Any], special: SpecialTokens) -> None:
    """Adds tokenizer_config.json's added tokens (in id order, so new ones land on their ids) and then the named
    and extra special tokens that the vocabulary lacks or holds only as ordinary pieces, as transformers does."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    for token_id, entry in sorted(added_tokens_decoder.items(), key=lambda item: int(item[0])):
        if entry["content"] not in present:
            backend.add_tokens([added_token(entry)])
            check_token_id(backend, entry["content"], int(token_id))
            present.add(entry["content"])
    missing = [t for t in special.all_tokens if t not in present]
    backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def added_token(entry: dict[str, Any]) -> AddedToken:
    flags = {k: entry[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in entry}
    return AddedToken(entry["content"], **flags)


def check_token_id(backend: Tokenizer, content: str, expected: int) -> None:
    actual = backend.token_to_id(content)
    if actual != expected:
        raise ValueError(f"added token {content!r} should have id {expected} but the vocabulary gives it {actual}; "
                         "tokenizer_config.json's added_tokens_decoder does not fit this vocabulary")


def bos_eos_processor(backend: Tokenizer, config: dict[str, Any],
                      special: SpecialTokens) -> processors.TemplateProcessing:
    """LlamaTokenizer's post-processor: BOS unless "add_bos_token": false, EOS only if "add_eos_token": true."""
    bos = [special.bos] if config.get("add_bos_token", True) and special.bos is not None else []
    eos = [special.eos] if config.get("add_eos_token", False) and special.eos is not None else []
    single = " ".join([f"{t}:0" for t in bos] + ["$A:0"] + [f"{t}:0" for t in eos])
    pair = single + " " + " ".join([f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos])
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(t, backend.token_to_id(t)) for t in bos + eos])
