"""OpenAI / vLLM request fields -> `StructuredOutputs`, validated before sending.

Accepted, one at a time: `response_format` (`json_object`; `json_schema` with
`json_schema.schema`), vLLM's `structured_outputs` extra (`json`, `regex`,
`choice`, `grammar`, `json_object`) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. The spec is checked by the caller
(server/openai/grammar_check.py: compiled for the tokenizer in a worker process,
under the compile deadline); a bad schema, regex or grammar is then a 400 that names
the field and the problem.
"""

from __future__ import annotations

import json
from typing import Any

from dpserve.frontend.errors import RequestError
from dpserve.structured.spec import StructuredOutputs

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_from_request(req: Any) -> tuple[str, StructuredOutputs] | None:
    """(the field that gave it, the request's constraint), None when unconstrained;
    RequestError naming the field for a malformed one (compiling is the caller's)."""
    found: list[tuple[str, StructuredOutputs]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        found.append(("response_format", _from_response_format(fmt)))
    extra = getattr(req, "structured_outputs", None)
    if extra:
        found.append(("structured_outputs", _from_extra(extra)))
    for field, kind in _GUIDED.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((field, _make(field, {kind: value})))
    if not found:
        return None
    if len(found) > 1:
        raise RequestError(f"only one of {', '.join(f for f, _ in found)} may be given",
                           param=found[1][0])
    return found[0]


def _from_response_format(fmt: Any) -> StructuredOutputs:
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if schema is None:
            raise RequestError("response_format json_schema needs json_schema.schema",
                               param="response_format")
        return _make("response_format", {"json": schema})
    raise RequestError(f"response_format type {fmt.type!r} is not supported; use 'text', "
                       f"'json_object' or 'json_schema'", param="response_format")


def _from_extra(extra: Any) -> StructuredOutputs:
    if not isinstance(extra, dict):
        raise RequestError("structured_outputs must be an object", param="structured_outputs")
    given = {k: v for k, v in extra.items() if k in _KINDS and v not in (None, False)}
    unknown = sorted(k for k in extra if k not in _KINDS and extra[k] is not None)
    if unknown:
        raise RequestError(f"structured_outputs: unsupported keys {unknown}; use one of "
                           f"{list(_KINDS)}", param="structured_outputs")
    return _make("structured_outputs", given)


def _make(field: str, values: dict[str, Any]) -> StructuredOutputs:
    if "json" in values and not isinstance(values["json"], str):
        if not isinstance(values["json"], (dict, bool)):
            raise RequestError(f"{field}: the JSON schema must be an object",
                               param=field)
        values = {**values, "json": json.dumps(values["json"])}
    if "json_object" in values:
        values = {**values, "json_object": bool(values["json_object"])}
    for key in ("regex", "grammar"):
        if key in values and not isinstance(values[key], str):
            raise RequestError(f"{field}: {key} must be a string", param=field)
    if "choice" in values and not isinstance(values["choice"], list):
        raise RequestError(f"{field}: choice must be a list of strings", param=field)
    try:
        return StructuredOutputs(**values)
    except (ValueError, TypeError) as e:
        raise RequestError(f"{field}: {e}", param=field) from None
