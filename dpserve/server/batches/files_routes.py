"""OpenAI's Files API: /v1/files (upload, list, retrieve, delete, content).

An upload is `multipart/form-data` with a `file` part and `purpose` "batch" (the
`openai` client's `files.create(file=..., purpose="batch")`); it is streamed to
the state directory as it arrives (`dpserve.server.batches.multipart`), never held whole
in memory, and a file over `--max-batch-file-bytes` is refused with a 413 naming
the flag (the body cap of this one route is that flag plus `MULTIPART_SLACK`,
not --max-request-body-bytes: `dpserve.server.bodies.BodyLimit`). Files are
shared by every API server of the server and outlive its restart when
`--state-dir` names the directory (`dpserve.server.batches.file_store`). A batch's output
and error files are listed here too (purpose "batch_output").

Errors are OpenAI's shape: an unknown id 404, a bad field 400 naming it.

Not here: the storage (`dpserve.server.batches.file_store`), batches
(`dpserve.server.batches.routes`).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, Response

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.server.batches.file_store import FileStore, new_file_id
from dpserve.server.batches.multipart import (
    FileTooLarge,
    MultipartError,
    boundary_of,
    receive_upload,
)
from dpserve.server.errors import APIError
from dpserve.server.openai.routes import drain_check

MULTIPART_SLACK = 64 << 10  # the form's own bytes (boundaries, headers, purpose)
PURPOSES = ("batch",)
MAX_LIST_LIMIT = 10000


def files_router(async_llm: AsyncLLM, files: FileStore, max_file_bytes: int) -> APIRouter:
    """The /v1/files routes (thin: parse, call `files`, answer)."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(drain_check(async_llm))])

    @v1.post("/files")
    async def upload(request: Request) -> Response:
        return json_response(await upload_file(request, files, max_file_bytes))

    @v1.get("/files")
    async def list_files(request: Request) -> Response:
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        page = await files.list(query.get("purpose"), list_limit(request, MAX_LIST_LIMIT,
                                                                 MAX_LIST_LIMIT),
                                query.get("after"), ascending=order == "asc")
        if page is None:
            raise APIError(400, f"after: no file {query.get('after')!r}", param="after")
        return json_response(list_page(*page))

    @v1.get("/files/{file_id}")
    async def retrieve(file_id: str) -> Response:
        return json_response(await _found(files, file_id))

    @v1.delete("/files/{file_id}")
    async def delete(file_id: str) -> Response:
        if not await files.delete(file_id):
            raise not_found(file_id)
        return json_response({"id": file_id, "object": "file", "deleted": True})

    @v1.get("/files/{file_id}/content")
    async def content(file_id: str) -> Response:
        await _found(files, file_id)
        return FileResponse(files.path(file_id), media_type="application/octet-stream")

    return v1


async def upload_file(request: Request, files: FileStore, max_file_bytes: int
                      ) -> dict[str, Any]:
    """Receive an upload (module docstring): the stored file's object."""
    file_id = new_file_id()
    part = files.part_path(file_id)
    try:
        boundary = boundary_of(request.headers.get("content-type", ""))
        upload = await receive_upload(request.stream(), boundary, "file", part,
                                      max_file_bytes)
        purpose = upload.fields.get("purpose")
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(PURPOSES)}, got "
                           f"{purpose!r}", param="purpose")
        if upload.filename is None:
            raise APIError(400, "the form has no 'file' part", param="file")
        return await files.add(file_id, purpose, upload.filename, upload.size)
    except MultipartError as e:
        raise APIError(400, str(e), param="file") from None
    except FileTooLarge:
        raise APIError(413, f"file larger than --max-batch-file-bytes ({max_file_bytes} "
                       f"bytes)", param="file", code="file_too_large") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)  # left only when the upload failed


def list_limit(request: Request, default: int, maximum: int) -> int:
    """`?limit=` in [1, maximum] (400 naming it otherwise)."""
    limit = request.query_params.get("limit", str(default))
    if not limit.isdigit() or not 1 <= int(limit) <= maximum:
        raise APIError(400, f"limit must be in [1, {maximum}], got {limit!r}", param="limit")
    return int(limit)


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def not_found(file_id: str, param: str = "file_id") -> APIError:
    return APIError(404, f"No such File object: {file_id}", param=param,
                    code="file_not_found")


async def _found(files: FileStore, file_id: str) -> dict[str, Any]:
    found = await files.get(file_id)
    if found is None:
        raise not_found(file_id)
    return found


def json_response(body: dict[str, Any]) -> Response:
    return Response(json.dumps(body), media_type="application/json")
