"""`StructuredOutputs`: what a request's output must match (travels in SamplingParams)."""

from __future__ import annotations

import json as _json

import msgspec


class StructuredOutputs(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Exactly one constraint: a JSON schema (as JSON text), any JSON object, a regular
    expression, one of several strings, or an EBNF grammar (xgrammar's dialect, which
    reads GBNF). Built by the API server from `response_format`, `structured_outputs`
    or the `guided_*` fields, or by offline users directly."""

    json: str | None = None  # a JSON schema, serialised
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # offline users may pass the schema itself
            self.json = _json.dumps(self.json)
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                         else [])
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, "
                             f"regex, choice, grammar; got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of "
                             "non-empty strings")

    def key(self) -> tuple[str, str]:
        """(kind, text): the compile cache's key."""
        if self.json is not None:
            return "json", self.json
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        return "grammar", self.grammar or ""
