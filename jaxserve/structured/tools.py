"""OpenAI tool calling: `tool_choice` as an output constraint, and the model's tool-call syntax as `tool_calls`.

    tool_choice "none"       tools reach the chat template; the output is plain content
    tool_choice "auto"       the output is parsed: calls in the model family's syntax become tool_calls
    tool_choice "required"   the output is constrained to a JSON array of {"name", "parameters"} objects, one
                             branch per tool, each with that tool's JSON Schema (at most one with
                             parallel_tool_calls false)
    tool_choice {function}   the output is constrained to that function's arguments (its JSON Schema)

Syntaxes `auto` parses (PARSERS; chosen by model family, or by the server's --tool-call-parser):
    hermes       Qwen 2/2.5/3, Hermes:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (repeatable)
    llama3_json  Llama 3.1+:  [<|python_tag|>]{"name": ..., "parameters": {...}}  (several joined by ";")
    mistral      Mistral:  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or  [TOOL_CALLS]name[ARGS]{...}
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Callable

from jaxserve.structured.grammar import closed_objects
from jaxserve.structured.params import StructuredOutputsParams

FAMILY_PARSERS = {"llama": "llama3_json", "qwen2": "hermes", "qwen3": "hermes", "mistral": "mistral"}


class ToolError(ValueError):
    """A malformed tools / tool_choice request: `param` is the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its generation: `mode` is none | auto | required | named;
    `constraint` the output constraint (required, named); `function` the named function's name."""

    mode: str
    constraint: StructuredOutputsParams | None = None
    function: str | None = None


def function_schemas(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """name -> parameters JSON Schema, checking the OpenAI shape {type: function, function: {name, parameters}}."""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError("each tool must be {\"type\": \"function\", \"function\": {...}}", f"tools[{i}]")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError("function.name must be 1-64 letters, digits, '_', '.' or '-'", f"tools[{i}].function.name")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError("function.parameters must be a JSON Schema object", f"tools[{i}].function.parameters")
        schemas[name] = closed_objects(parameters) if function.get("strict") is True else parameters
    return schemas


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict | None,
               parallel_tool_calls: bool | None = None) -> ToolPlan:
    """The request's tool mode and, for required / named, its output constraint. Raises ToolError."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    schemas = function_schemas(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return ToolPlan(choice)
    if choice == "required":
        return ToolPlan("required", StructuredOutputsParams(json=required_schema(schemas, parallel_tool_calls)))
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", "tool_choice")
        if name not in schemas:
            raise ToolError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return ToolPlan("named", StructuredOutputsParams(json=schemas[name]), name)
    raise ToolError(f"tool_choice must be none, auto, required or a function, not {choice!r}", "tool_choice")


def required_schema(schemas: dict[str, dict], parallel_tool_calls: bool | None) -> dict:
    """A JSON array of calls, each {"name": one tool's name, "parameters": that tool's arguments}."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in schemas.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def calls_from_required(text: str) -> list[ToolCall]:
    """The tool calls of a `required` output (a JSON array; empty if it was cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [ToolCall(item["name"], _dumps(item.get("parameters", {}))) for item in items
            if isinstance(item, dict) and isinstance(item.get("name"), str)]


# ---- parsing the model's own syntax (tool_choice auto) ---------------------------------------------------------
def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls, content = [], []
    position = 0
    for match in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL):
        content.append(text[position:match.start()])
        position = match.end()
        call = _call_from_json(match.group(1).strip(), "arguments")
        if call is None:
            return text, []
        calls.append(call)
    content.append(text[position:])
    return "".join(content).strip(), calls


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            value, end = decoder.raw_decode(body, position)
        except ValueError:
            return text, []
        call = _call_from_value(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
    return "", calls


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    marker = text.find("[TOOL_CALLS]")
    if marker < 0:
        return text, []
    content, rest = text[:marker].strip(), text[marker + len("[TOOL_CALLS]"):].strip()
    if rest.startswith("["):
        try:
            items = json.loads(rest)
        except ValueError:
            return text, []
        calls = [_call_from_value(item, "arguments") for item in (items if isinstance(items, list) else [])]
        return (content, calls) if calls and None not in calls else (text, [])
    calls = []
    for segment in rest.split("[TOOL_CALLS]"):
        name, sep, arguments = segment.partition("[ARGS]")
        try:
            calls.append(ToolCall(name.strip(), _dumps(json.loads(arguments))))
        except ValueError:
            return text, []
        if not sep or not name.strip():
            return text, []
    return content, calls


PARSERS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}
# Where a call may begin: content before it streams as content; from it on, output is held until the end.
MARKERS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]",)}
LEADING_ONLY = {"llama3_json"}  # its calls are the whole output, never after content


def parser_for(family: str, name: str | None = None) -> str | None:
    """The tool-call syntax to parse: `name` if given, else the model family's (None: the family has none)."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
        return name
    return FAMILY_PARSERS.get(family)


class ToolCallStream:
    """Streams content until a tool call may have begun, then holds the rest; finish() parses what it held.

    feed(text delta) -> content to send now;  finish() -> (content still to send, tool calls)."""

    def __init__(self, parser: str):
        self.parser = parser
        self._sent = ""
        self._text = ""
        self._holding = False

    def feed(self, delta: str) -> str:
        self._text += delta
        if self._holding:
            return ""
        start = self._call_start()
        if start is not None:
            self._holding = True
            return self._release(start)
        return self._release(len(self._text) - self._possible_marker_prefix())

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = PARSERS[self.parser](self._text)
        if not calls:
            return self._release(len(self._text)), []
        # what streamed already was content before the call; send the rest of the content now
        rest = content[len(self._sent.strip()):] if content.startswith(self._sent.strip()) else ""
        return rest, calls

    def _release(self, end: int) -> str:
        out = self._text[len(self._sent):max(end, len(self._sent))]
        self._sent += out
        return out

    def _call_start(self) -> int | None:
        text = self._text
        if self.parser in LEADING_ONLY:
            stripped = text.lstrip()
            if any(stripped.startswith(m) for m in MARKERS[self.parser]):
                return len(text) - len(stripped)
            return None
        found = [i for i in (text.find(m) for m in MARKERS[self.parser]) if i >= 0]
        return min(found) if found else None

    def _possible_marker_prefix(self) -> int:
        """Characters at the end that could be the start of a marker: not sent until that is known."""
        text = self._text
        if self.parser in LEADING_ONLY:
            stripped = text.lstrip()
            return len(text) if any(m.startswith(stripped) for m in MARKERS[self.parser]) else 0
        longest = 0
        for marker in MARKERS[self.parser]:
            for size in range(1, len(marker)):
                if text.endswith(marker[:size]):
                    longest = max(longest, size)
        return longest


def _call_from_json(text: str, arguments_key: str) -> ToolCall | None:
    try:
        return _call_from_value(json.loads(text), arguments_key)
    except ValueError:
        return None


def _call_from_value(value: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else _dumps(arguments))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
