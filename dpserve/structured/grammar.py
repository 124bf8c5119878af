"""Validating and compiling a `StructuredOutputs` spec with xgrammar.

Why xgrammar (bench/grammar_choice.py: SmolLM2's 49,152-token vocabulary, CPU): per
token mask 14-80 us against llguidance's 10-105 us, compile 5-24 ms against 1-14 ms
(compiles are cached and off the busy loop); a tie on speed, so the rest decided:
xgrammar takes regex, EBNF and JSON schema directly, validates without a tokenizer
(the API server checks specs before sending), and is vLLM's default, so grammars
written for vLLM behave the same. Its cost: it depends on triton (a large wheel,
unused on CPU).

JSON is generated without free whitespace: a model cannot spend its whole budget
on spaces, and the text is laid out as `json.dumps` writes it (", " and ": "),
keys in the schema's order.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

from dpserve.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)

_SEPARATORS = (", ", ": ")
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+\.cc:\d+: ")
# Test-only fault injection: "MARKER:PATH": a compile of a spec whose text holds MARKER
# waits until PATH exists (at most HOLD_COMPILE_LIMIT_S), so a test has a compile past
# its deadline on any machine, in the engine and in the API server's compile worker.
FAULT_HOLD_COMPILE_ENV = "DPSERVE_FAULT_HOLD_COMPILE"
HOLD_COMPILE_LIMIT_S = 300.0


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(spec: StructuredOutputs) -> Any:
    """The xgrammar Grammar of a spec (no tokenizer needed); raises ValueError."""
    import xgrammar as xgr

    kind, text = spec.key()
    try:
        if kind == "json":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("the JSON schema must be an object")
            _check_schema(schema)
            return _no_control_chars(xgr.Grammar.from_json_schema(
                text, any_whitespace=False, separators=_SEPARATORS))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                separators=_SEPARATORS, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice or []))
        return xgr.Grammar.from_ebnf(text)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError & co. on bad input
        lines = str(e).strip().splitlines()
        reason = _LOCATION.sub("", lines[-1]) if lines else type(e).__name__
        raise ValueError(f"invalid {_NAMES[kind]}: {reason}") from None


# xgrammar 0.2.8's JSON string characters let invalid JSON / UTF-8 through:
# strings with minLength/maxLength take control characters, and every string takes
# UTF-16 surrogates (U+D800-DFFF, not encodable in UTF-8: they decode as U+FFFD).
# The character classes are narrowed here: (written by xgrammar, narrowed).
_CHAR_CLASSES = [(r'[^\"\\\r\n]', r'[^\"\\\0-\x1f\uD800-\uDFFF]'),
                 (r'[^\0-\x1f\"\\\r\n]', r'[^\0-\x1f\"\\\uD800-\uDFFF]')]


def _no_control_chars(grammar: Any) -> Any:
    import xgrammar as xgr

    text = original = str(grammar)
    for loose, strict in _CHAR_CLASSES:
        text = text.replace(loose, strict)
    return grammar if text == original else xgr.Grammar.from_ebnf(text)


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar",
          "regex": "regular expression", "choice": "choice", "grammar": "grammar"}


def _check_schema(schema: Any) -> None:
    """The schema against its metaschema (jsonschema, when installed)."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ValueError(f"invalid JSON schema{' at ' + where if where else ''}: "
                         f"{e.message}") from None


def spec_from_key(kind: str, text: str) -> StructuredOutputs:
    """The spec of a `StructuredOutputs.key()` (kind, text)."""
    return (StructuredOutputs(json=text) if kind == "json" else
            StructuredOutputs(json_object=True) if kind == "json_object" else
            StructuredOutputs(regex=text) if kind == "regex" else
            StructuredOutputs(choice=json.loads(text)) if kind == "choice" else
            StructuredOutputs(grammar=text))


def validate(spec: StructuredOutputs) -> None:
    """Raise ValueError naming the problem if `spec` cannot be compiled (no tokenizer,
    no deadline: the API server checks specs in `compile_worker` instead)."""
    _grammar(spec)


def compile_spec(compiler: Any, spec: StructuredOutputs) -> Any:
    """spec -> xgrammar CompiledGrammar for the compiler's tokenizer."""
    _maybe_hold_compile(spec)
    return compiler.compile_grammar(_grammar(spec))


def _maybe_hold_compile(spec: StructuredOutputs) -> None:
    """TEST-ONLY: with DPSERVE_FAULT_HOLD_COMPILE=MARKER:PATH, a spec whose text holds
    MARKER compiles only once PATH exists (the test creates it to release the compile),
    or after HOLD_COMPILE_LIMIT_S; every other spec compiles at once."""
    marker, _, path = os.environ.get(FAULT_HOLD_COMPILE_ENV, "").partition(":")
    if not marker or marker not in spec.key()[1]:
        return
    logger.warning("TEST-ONLY: a compile holds until %s exists (%s)", path,
                   FAULT_HOLD_COMPILE_ENV)
    deadline = time.monotonic() + HOLD_COMPILE_LIMIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
