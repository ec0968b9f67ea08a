"""Chat templates rendered the way transformers renders them (apply_chat_template(..., tokenize=False)).

Environment: jinja2's ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, loop controls and the
`{% generation %}` tag; `tojson` that keeps non-ASCII text; globals raise_exception, strftime_now and a namespace
that refuses underscore attributes. Variables: messages, tools, documents, add_generation_prompt, the model's
named special tokens (bos_token, eos_token, unk_token, pad_token, ... when it has them) and any extra keywords.
Messages are normalised first, as transformers 5 does: keys whose value is None are dropped, and reasoning given
as reasoning_content, thinking or reasoning is visible under both reasoning_content and thinking.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

NO_CHAT_TEMPLATE = "this model has no chat template; use /v1/completions or give the tokenizer a chat_template"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: the template called raise_exception (the message is the template's own,
    unchanged) or failed on them. A client error: the server answers 400 with str(error)."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template (server: 400, pointing at /v1/completions)."""

    def __init__(self, message: str = NO_CHAT_TEMPLATE):
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class ChatTemplates:
    """A model's chat templates, compiled once. `templates` maps names to compiled templates; a lone template is
    "default", and "tool_use" (when present) is used for requests that carry tools. `variables` are the
    special-token strings every render sees."""

    templates: dict[str, jinja2.Template]
    variables: dict[str, str]

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               tools: list[dict] | None, documents: list[dict] | None, extra: dict[str, Any]) -> str:
        template = self.select(tools)
        try:
            return template.render(messages=normalized_messages(messages), tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **{**self.variables, **extra})
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e

    def select(self, tools: list[dict] | None) -> jinja2.Template:
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if not self.templates:
            raise NoChatTemplateError()
        raise ChatTemplateError(f"this model has several chat templates and none named 'default': "
                                f"{sorted(self.templates)}")


def compile_chat_templates(sources: dict[str, str], variables: dict[str, str]) -> ChatTemplates:
    """Compiles every template now, so a broken one fails at load time, not on the first request."""
    environment = chat_environment()
    compiled = {}
    for name, source in sources.items():
        try:
            compiled[name] = environment.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template {name!r} does not compile: {e} (line {e.lineno})") from e
    return ChatTemplates(templates=compiled, variables=dict(variables))


def chat_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols, GenerationTag])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.globals["namespace"] = TemplateNamespace
    return environment


def raise_exception(message: str):
    raise ChatTemplateError(message)


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Replaces Jinja's tojson, which escapes HTML characters and takes no json.dumps options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace(), refusing underscore names so a template cannot reach CPython internals through it."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]  # Jinja's own signature trick, so namespace(self=...) still works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("render_body"), [], [], body).set_lineno(lineno)

    def render_body(self, caller: Any) -> str:
        return caller()


def normalized_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty list of messages")
    return [normalized_message(m) for m in messages]


def normalized_message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"chat messages must be objects, got {type(message).__name__}")
    plain = {key: value for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in REASONING_FIELDS if key in plain), None)
    if reasoning is None:
        return plain
    return {"thinking": reasoning, **plain, "reasoning_content": reasoning}
