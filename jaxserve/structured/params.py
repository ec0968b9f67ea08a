"""What a request asks its output to match (vLLM's `StructuredOutputsParams`). Pure Python: no grammar engine here.

Exactly one constraint per request:
    json            a JSON Schema (dict or JSON text): the output is one JSON value valid against it
    json_object     any JSON object (OpenAI's response_format {"type": "json_object"})
    regex           the whole output matches the regular expression (Rust `regex` syntax, anchored at both ends)
    choice          the output is exactly one of these strings
    grammar         a context-free grammar: Lark syntax (llguidance's) or GBNF (llama.cpp's)

The value is frozen and hashable (a schema is kept as compact JSON text, its key order kept): SamplingParams hashes it, and the
compiled-grammar cache is keyed by it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.validation import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar larger than 1 MiB of text is refused before compiling


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None  # canonical JSON text of the schema (a dict given here is serialised)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    # JSON layout. Compact by default (no whitespace between tokens, as OpenAI's structured outputs): a model
    # that may emit any whitespace anywhere can also emit nothing else. `whitespace_pattern` (a regex) allows some;
    # disable_any_whitespace (vLLM's switch to compact) is accepted and is the default here.
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False  # objects without additionalProperties get false (OpenAI strict)

    def __post_init__(self):
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", canonical_json(self.json))
        elif isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", canonical_json(json.loads(self.json)))
            except ValueError:
                pass  # kept as given; check() names the problem
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice) if isinstance(self.choice, (list, tuple))
                               else self.choice)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS (check() guarantees exactly one is set)."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def check(self) -> None:
        """Raises InvalidRequestError (param "structured_outputs") for a malformed constraint. Whether a schema,
        regex or grammar compiles is the grammar engine's verdict (jaxserve.structured.grammar)."""
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise _invalid(f"needs exactly one of {', '.join(KINDS)}; got "
                           f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        if kind == "json":
            _check_schema_text(self.json)
        if kind == "choice":
            _check_choice(self.choice)
        if self.whitespace_pattern is not None and (not isinstance(self.whitespace_pattern, str)
                                                    or not self.whitespace_pattern):
            raise _invalid("whitespace_pattern must be a non-empty regular expression")
        if kind in ("regex", "grammar"):
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise _invalid(f"{kind} must be a non-empty string")
            if len(text) > MAX_SPEC_CHARS:
                raise _invalid(f"{kind} is longer than {MAX_SPEC_CHARS} characters")


def canonical_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # key order kept: it orders the output


def _check_schema_text(text: Any) -> None:
    if not isinstance(text, str):
        raise _invalid("json must be a JSON Schema (an object, or its JSON text)")
    if len(text) > MAX_SPEC_CHARS:
        raise _invalid(f"the JSON schema is longer than {MAX_SPEC_CHARS} characters")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise _invalid(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise _invalid(f"a JSON Schema is an object (or true/false), not {type(schema).__name__}")


def _check_choice(choice: Any) -> None:
    if not isinstance(choice, tuple) or not choice:
        raise _invalid("choice must be a non-empty array of strings")
    if len(choice) > MAX_CHOICES:
        raise _invalid(f"choice may hold at most {MAX_CHOICES} strings")
    if not all(isinstance(c, str) and c for c in choice):
        raise _invalid("choice must hold non-empty strings")


def _invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{{structured_outputs}}: {message}", "structured_outputs")
