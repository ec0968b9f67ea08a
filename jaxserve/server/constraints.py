"""The request fields that constrain the output, as one StructuredOutputsParams (jaxserve.structured).

    response_format  {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                     (strict: objects that do not say otherwise allow no extra keys, as OpenAI's strict mode)
    structured_outputs  vLLM's object: json | regex | choice | grammar | json_object (+ whitespace_pattern,
                        disable_additional_properties, disable_any_whitespace)
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older names

At most one of them may be given (response_format "text" counts as none). The engine compiles the result; an
error names the field the client used (`field` below).
"""

from __future__ import annotations

from typing import Any

from jaxserve.server.errors import bad_request
from jaxserve.server.protocol import SamplingFields
from jaxserve.structured import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from, or (None, None). 400 when several are given."""
    given: list[tuple[StructuredOutputsParams, str]] = []
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        given.append((_from_response_format(response_format), "response_format"))
    if body.structured_outputs is not None:
        fields = body.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        fields.pop("disable_fallback", None)
        given.append((StructuredOutputsParams(**fields), "structured_outputs"))
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            given.append((StructuredOutputsParams(**{kind: value}), name))
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not several: {', '.join(field for _, field in given)}",
                          param=given[1][1])
    return given[0] if given else (None, None)


def _from_response_format(response_format) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", param="response_format.json_schema")
    return StructuredOutputsParams(json=spec.schema_, disable_additional_properties=bool(spec.strict))


def field_names(field: str | None) -> dict[str, Any]:
    """InvalidRequestError's "structured_outputs" in the request's own words."""
    return {"structured_outputs": field} if field is not None else {}
