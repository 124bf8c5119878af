"""OpenAI's batch file format: the input lines, their checks, and the output lines.

Shared by the server's batches (`dpserve.server.batches.runner`) and `dpserve
run-batch` (`dpserve.entrypoints.run_batch`), so both read and write the same.

An input line (JSONL, one request per non-blank line):
  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
`custom_id` a non-empty string, unique in the file; `method` POST; `url` one of
`ENDPOINTS` and the batch's endpoint; `body` an object (the request, as the
endpoint takes it). Lines are numbered from 1 as they stand in the file (blank
lines count but carry no request).

An output line:
  {"id": "batch_req_...", "custom_id": "r1",
   "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}},
   "error": null}
A request the endpoint refused carries its status and OpenAI's error body
(`{"error": {...}}`) in `response`; a line that never reached an endpoint has
`response: null` and `error: {"code", "message"}`.

Not here: running lines (the server's runner, run-batch).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)
MAX_ERRORS = 100  # validation errors reported at most (the first ones)


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based line number in the file
    custom_id: str
    url: str
    body: dict[str, Any]  # the request body, as the endpoint takes it


class LineError(ValueError):
    """A line that fails the checks: OpenAI's batch error entry (`entry()`)."""

    def __init__(self, line: int | None, message: str, param: str | None = None,
                 code: str = "invalid_request") -> None:
        super().__init__(message)
        self.line, self.message, self.param, self.code = line, message, param, code

    def entry(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line, read as it goes (never whole)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield number, "\ufffd"  # not JSON: parse_line names the line


def parse_line(text: str, line: int, endpoint: str | None = None) -> BatchLine:
    """One input line checked (module docstring); LineError naming it otherwise.
    `endpoint`: the batch's (None: any of `ENDPOINTS`)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(line, f"line {line} is not valid JSON: {e.msg}",
                        code="invalid_json_line") from None
    if not isinstance(obj, dict):
        raise LineError(line, f"line {line} must be a JSON object", code="invalid_json_line")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(line, f"line {line}: custom_id must be a non-empty string",
                        param="custom_id")
    if obj.get("method") != "POST":
        raise LineError(line, f"line {line}: method must be 'POST', got "
                        f"{obj.get('method')!r}", param="method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError(line, f"line {line}: url {url!r} is not supported; the batch "
                        f"endpoints are {', '.join(ENDPOINTS)}", param="url",
                        code="invalid_url")
    if endpoint is not None and url != endpoint:
        raise LineError(line, f"line {line}: url {url!r} is not the batch's endpoint "
                        f"{endpoint!r}", param="url", code="mismatched_url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(line, f"line {line}: body must be a JSON object", param="body")
    return BatchLine(line, custom_id, url, body)


def check_file(path: str, endpoint: str | None) -> tuple[int, list[dict[str, Any]]]:
    """Every line of an input file checked, read as it goes: (number of requests, the
    first `MAX_ERRORS` errors as OpenAI's entries; none: the file is good)."""
    seen: set[str] = set()
    total, errors = 0, []
    for number, text in read_lines(path):
        total += 1
        try:
            line = parse_line(text, number, endpoint)
            if line.custom_id in seen:
                raise LineError(number, f"line {number}: custom_id {line.custom_id!r} is "
                                f"used by an earlier line; each must be unique",
                                param="custom_id", code="duplicate_custom_id")
            seen.add(line.custom_id)
        except LineError as e:
            if len(errors) < MAX_ERRORS:
                errors.append(e.entry())
    if total == 0:
        errors.append(LineError(None, "the input file has no requests",
                                code="empty_file").entry())
    return total, errors


def output_line(custom_id: str, status_code: int, request_id: str | None,
                body: dict[str, Any]) -> dict[str, Any]:
    """The line of a request an endpoint answered (its body, or its error body)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id,
                         "body": body}, "error": None}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def failed_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """The line of a request that never reached an endpoint."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": None, "error": {"code": code, "message": message}}
