"""Request models declared once: dataclasses whose fields carry a JSON Schema. The same declaration validates a
request body (`parse_request`) and describes it in /openapi.json (`request_schema`).

    @dataclasses.dataclass(frozen=True)
    class DetokenizeRequest:
        tokens: list = param(array_of(INTEGER_MIN0), required=True, description="token ids")

Validation covers the JSON Schema subset the models use: type (one or a list), enum, minimum, maximum,
exclusiveMinimum, minLength, maxLength, pattern, items, minItems, maxItems, maxProperties, properties, required,
additionalProperties, propertyNames, anyOf. Unknown body fields are ignored, as OpenAI-compatible servers do.
An explicit null means "not given": the field takes its default. Errors are 400s that name the field at fault.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

from jaxserve.server.errors import APIError, bad_request

JSON_TYPES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
              "array": "an array", "object": "an object", "null": "null"}


def param(schema: dict, default: Any = None, *, required: bool = False, description: str = "") -> Any:
    """A request field: its JSON schema (without null: every optional field also accepts null) and default."""
    return dataclasses.field(default=default, metadata={"schema": schema, "required": required,
                                                        "description": description})


@functools.cache
def request_schema(model_class: type) -> dict:
    """The JSON schema of a request model, as /openapi.json publishes it. Cached: callers must not mutate it."""
    properties, required = {}, []
    for field in dataclasses.fields(model_class):
        schema = dict(field.metadata["schema"])
        if field.metadata["description"]:
            schema["description"] = field.metadata["description"]
        if field.metadata["required"]:
            required.append(field.name)
        else:
            schema = nullable(schema)
            if field.default is not None:
                schema["default"] = field.default
        properties[field.name] = schema
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": True}


def parse_request(model_class: type, body: Any):
    """Validates a decoded JSON body against the model's schema and builds the model (defaults for absent/null)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    body = check(body, request_schema(model_class), "")
    values = {}
    for field in dataclasses.fields(model_class):
        value = body.get(field.name)
        values[field.name] = field.default if value is None else value
    return model_class(**values)


def nullable(schema: dict) -> dict:
    if "anyOf" in schema:
        return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    types = schema.get("type")
    if types is None:
        return schema
    types = [types] if isinstance(types, str) else list(types)
    return {**schema, "type": types if "null" in types else [*types, "null"]}


# ---- validation ---------------------------------------------------------------------------------------------
def check(value: Any, schema: dict, path: str) -> Any:
    """Raises a 400 naming `path` when `value` does not satisfy `schema`; returns the value with integral numbers
    in integer fields as ints (JSON Schema counts 2.0 as an integer)."""
    if "anyOf" in schema:
        return _check_any_of(value, schema, path)
    if "type" in schema and not _has_type(value, schema["type"]):
        raise _invalid(path, f"must be {describe(schema)}, not {_json_type_name(value)}")
    value = _as_int_if_integer(value, schema.get("type"))
    for keyword, checker in _CHECKS:
        if keyword in schema:
            checker(value, schema, path)
    if isinstance(value, list) and "items" in schema:
        return [check(item, schema["items"], f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        checked = _check_members(value, schema, path)
        _check_required(value, schema, path)  # after the members: a wrong "type" says more than a missing "text"
        return checked
    return value


def _as_int_if_integer(value: Any, types: str | list[str] | None) -> Any:
    types = [types] if isinstance(types, str) else types or []
    if isinstance(value, float) and "integer" in types and "number" not in types:
        return int(value)
    return value


def _check_members(value: dict, schema: dict, path: str) -> dict:
    """Known properties against their schemas, the others against additionalProperties (if it is a schema)."""
    known = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    checked = {}
    for name, item in value.items():
        if name in known:
            checked[name] = check(item, known[name], _join(path, name))
        elif extra is False:
            raise _invalid(_join(path, name), "is not a known field")
        elif isinstance(extra, dict):
            checked[name] = check(item, extra, _join(path, name))
        else:
            checked[name] = item
    return checked


def _check_any_of(value: Any, schema: dict, path: str) -> Any:
    """The error reported is that of the branch the value resembles most: right type, right first item."""
    matching = [branch for branch in schema["anyOf"] if _has_type(value, branch.get("type"))]
    resembling = [branch for branch in matching if _first_item_fits(value, branch)]
    matching = resembling or matching
    if not matching:
        raise _invalid(path, f"must be {describe(schema)}, not {_json_type_name(value)}")
    errors = []
    for branch in matching:
        try:
            return check(value, branch, path)
        except APIError as exc:
            errors.append(exc)
    raise errors[0]


def _first_item_fits(value: Any, schema: dict) -> bool:
    if not isinstance(value, list) or not value or "items" not in schema:
        return True
    return _has_type(value[0], schema["items"].get("type"))


def _has_type(value: Any, types: str | list[str] | None) -> bool:
    if types is None:
        return True
    return any(_is_json_type(value, t) for t in ([types] if isinstance(types, str) else types))


def _is_json_type(value: Any, json_type: str) -> bool:
    if json_type == "integer":
        integral_float = isinstance(value, float) and value.is_integer()
        return (isinstance(value, int) and not isinstance(value, bool)) or integral_float
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python_type = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}[json_type]
    return isinstance(value, python_type)


def _json_type_name(value: Any) -> str:
    for json_type in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_json_type(value, json_type):
            return JSON_TYPES[json_type]
    return type(value).__name__


def describe(schema: dict) -> str:
    """'a string or an array of strings', for error messages."""
    if "anyOf" in schema:
        return " or ".join(describe(branch) for branch in schema["anyOf"])
    types = schema.get("type", [])
    names = []
    for json_type in ([types] if isinstance(types, str) else types):
        if json_type == "array" and "items" in schema:
            names.append(f"an array of {_plural(describe(schema['items']))}")
        else:
            names.append(JSON_TYPES[json_type])
    return " or ".join(names) or "a value"


def _plural(description: str) -> str:
    """'a string' -> 'strings', 'an array of integers' -> 'arrays of integers'."""
    words = description.split(" or ")
    return " or ".join(_plural_one(w) for w in words)


def _plural_one(description: str) -> str:
    head, _, rest = description.partition(" ")
    if head not in ("a", "an"):
        return description
    noun, _, tail = rest.partition(" ")
    return f"{noun}s {tail}".strip()


def _check_enum(value, schema, path):
    if value not in schema["enum"]:
        raise _invalid(path, f"must be one of {', '.join(map(repr, schema['enum']))}, not {value!r}")


def _check_minimum(value, schema, path):
    if _is_number(value) and value < schema["minimum"]:
        raise _invalid(path, f"must be >= {schema['minimum']}, got {value}")


def _check_maximum(value, schema, path):
    if _is_number(value) and value > schema["maximum"]:
        raise _invalid(path, f"must be <= {schema['maximum']}, got {value}")


def _check_exclusive_minimum(value, schema, path):
    if _is_number(value) and value <= schema["exclusiveMinimum"]:
        raise _invalid(path, f"must be > {schema['exclusiveMinimum']}, got {value}")


def _check_min_length(value, schema, path):
    if isinstance(value, str) and len(value) < schema["minLength"]:
        raise _invalid(path, "must not be empty" if schema["minLength"] == 1
                       else f"must have at least {schema['minLength']} characters")


def _check_max_length(value, schema, path):
    if isinstance(value, str) and len(value) > schema["maxLength"]:
        raise _invalid(path, f"must have at most {schema['maxLength']} characters")


def _check_pattern(value, schema, path):
    if isinstance(value, str) and not re.search(schema["pattern"], value):  # JSON Schema patterns are unanchored
        raise _invalid(path, f"must match {schema['pattern']}, got {value!r}")


def _check_min_items(value, schema, path):
    if isinstance(value, list) and len(value) < schema["minItems"]:
        raise _invalid(path, "must not be empty" if schema["minItems"] == 1
                       else f"must have at least {schema['minItems']} items")


def _check_max_items(value, schema, path):
    if isinstance(value, list) and len(value) > schema["maxItems"]:
        raise _invalid(path, f"must have at most {schema['maxItems']} items")


def _check_max_properties(value, schema, path):
    if isinstance(value, dict) and len(value) > schema["maxProperties"]:
        raise _invalid(path, f"may hold at most {schema['maxProperties']} entries")


def _check_required(value, schema, path):
    if isinstance(value, dict):
        for name in schema.get("required", ()):
            if name not in value:
                raise _invalid(_join(path, name), "is required")


def _check_property_names(value, schema, path):
    if isinstance(value, dict):
        for name in value:
            check(name, schema["propertyNames"], _join(path, name))


_CHECKS = (
    ("enum", _check_enum), ("minimum", _check_minimum), ("maximum", _check_maximum),
    ("exclusiveMinimum", _check_exclusive_minimum), ("minLength", _check_min_length),
    ("maxLength", _check_max_length), ("pattern", _check_pattern), ("minItems", _check_min_items),
    ("maxItems", _check_max_items), ("maxProperties", _check_max_properties),
    ("propertyNames", _check_property_names),
)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _invalid(path: str, message: str):
    return bad_request(f"{path or 'the request body'} {message}", param=path or None)
