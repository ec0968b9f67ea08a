"""Compiling a request's constraint with llguidance (the grammar engine; see the README for why this one), once per
(constraint, tokenizer): the compiled grammar is a template matcher, and each constrained sequence gets a cheap
deep copy of it.

    StructuredOutputsParams --grammar_text()--> llguidance grammar (JSON Schema / regex / Lark)
                            --GrammarCompiler.compile()--> template LLMatcher (cached, LRU)
                            --CompiledGrammar.matcher()--> a copy per sequence

A constraint the engine cannot compile (invalid schema, unsupported keyword, bad regex, grammar syntax error) is an
InvalidRequestError naming the problem, raised before the request is queued.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from typing import Iterable

from jaxserve.structured.params import StructuredOutputsParams
from jaxserve.validation import InvalidRequestError

DEFAULT_CACHE_SIZE = 256


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled constraint: a matcher at the grammar's start, never advanced itself; `compile_seconds` is what
    compiling it cost (0 for a cache hit's copy)."""

    template: object  # llguidance.LLMatcher
    compile_seconds: float

    def matcher(self):
        """A fresh matcher at the start of the grammar, for one sequence."""
        return self.template.deep_copy()


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (not yet checked: compiling does that)."""
    import llguidance
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = json.loads(params.json) if kind == "json" else {"type": "object"}
        if params.disable_additional_properties:
            schema = closed_objects(schema)
        options = ({"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
                   if params.whitespace_pattern else {"whitespace_flexible": False})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise _invalid(f"the JSON schema cannot be used: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(choice) for choice in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise _invalid(f"the grammar cannot be read: {exc}") from None


def closed_objects(schema):
    """The schema with additionalProperties false on every object schema that does not say (vLLM's
    disable_additional_properties; OpenAI's strict mode requires it)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed_objects(value) if key not in ("enum", "const", "default", "examples") else value
           for key, value in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarCompiler:
    """Compiles constraints for one tokenizer and caches them (least recently used out). Thread-safe: the server
    compiles in a worker thread before queueing a request, the engine thread finds the result in the cache.

    `vocab_size` is the model's (its logits' width): token ids the tokenizer lacks are never allowed.
    `eos_token_ids` are the ids that end a sequence: allowed exactly where the grammar may end."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[StructuredOutputsParams, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None

    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (each token's bytes), built on first use."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._ll_tokenizer

    @property
    def mask_words(self) -> int:
        """int32 words in one llguidance token bitmask."""
        return (self.ll_tokenizer.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The cached grammar for `params`, compiled now if it is not cached. Raises InvalidRequestError."""
        with self._lock:
            cached = self._cache.get(params)
            if cached is not None:
                self._cache.move_to_end(params)
                return cached
        compiled = self._compile(params)
        with self._lock:
            self._cache[params] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance
        params.check()
        tokenizer = self.ll_tokenizer
        started = time.perf_counter()
        grammar = grammar_text(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise _invalid(f"the {_describe(params)} does not compile: {_first_line(error)}")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _invalid(f"the {_describe(params)} does not compile: {_first_line(template.get_error())}")
        return CompiledGrammar(template, time.perf_counter() - started)


def build_ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """An llguidance tokenizer from ours (a Hugging Face `tokenizers` backend, also for sentencepiece models):
    llguidance reads the tokenizer.json text and derives each token's bytes."""
    import llguidance
    backend = tokenizer.backend
    n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    eos = eos_token_ids or list(tokenizer.eos_token_ids)
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)


def _describe(params: StructuredOutputsParams) -> str:
    return {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[params.kind]


def _first_line(message: str) -> str:
    """llguidance appends its parser state to some errors; the first lines say what is wrong."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    head = lines[0] if lines else message
    for line in lines[1:3]:
        if line.startswith("<"):
            break
        head += " " + line.strip()
    return head[:500]


def _invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{{structured_outputs}}: {message}", "structured_outputs")
