"""The Responses API's store on its own (no model): the file's modes, two stores on
one file (as two API servers), eviction, the size limit, chains with a missing link,
cancel marks, and the options' one-line errors."""

from __future__ import annotations

import argparse
import asyncio
import os
import stat

import pytest

from dpserve.errors import ConfigError
from dpserve.server.responses.store import (
    ResponseStore,
    ResponseStoreOptions,
    TooLarge,
    add_response_store_args,
    response_store_file,
)


def _response(rid: str, status: str = "completed", text: str = "") -> dict:
    return {"id": rid, "status": status, "output": [{"type": "message", "text": text}]}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_response_store_args(parser)
    return parser.parse_args(list(argv))


def test_private_state_dir_two_stores_and_removal() -> None:
    with response_store_file(ResponseStoreOptions()) as options:
        directory = os.path.dirname(options.path)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(options.path).st_mode) == 0o600

        async def two_servers() -> None:
            a, b = (ResponseStore(options.path, 100, 1 << 20) for _ in range(2))
            await a.put(_response("resp_1", "in_progress"), [{"id": "i1"}], None)
            assert (await b.get("resp_1")).input_items == [{"id": "i1"}]
            assert (await b.request_cancel("resp_1")).response["status"] == "cancelled"
            assert await a.cancelled(["resp_1", "resp_x"]) == {"resp_1"}
            assert not await a.finish(_response("resp_1"))  # not over the cancel
            assert (await b.get("resp_1")).response["status"] == "cancelled"
            a.close()
            b.close()

        asyncio.run(two_servers())
    assert not os.path.exists(directory)


def test_chains_eviction_and_size_limit(tmp_path) -> None:
    async def run() -> None:
        store = ResponseStore(str(tmp_path / "s.sqlite"), 3, 400)
        await store.put(_response("r1"), [{"id": "a"}], None)
        await store.put(_response("r2"), [{"id": "b"}], "r1")
        chain = await store.conversation("r2")
        assert [c.response["id"] for c in chain] == ["r1", "r2"]
        assert await store.conversation("nope") is None
        for rid in ("r3", "r4"):
            await store.put(_response(rid), [], "r2")
        assert await store.count() == 3 and await store.get("r1") is None  # oldest out
        assert await store.conversation("r3") is None  # its chain lost r1
        finished = _response("r2")
        assert (await store.request_cancel("r2")).response["status"] == "completed"
        assert await store.finish(finished)
        with pytest.raises(TooLarge, match="--max-stored-response-bytes"):
            await store.put(_response("big", text="x" * 500), [], None)
        assert await store.delete("r4") and not await store.delete("r4")
        store.close()

    asyncio.run(run())


def test_options_errors(tmp_path) -> None:
    assert ResponseStoreOptions.from_args(_args()) == ResponseStoreOptions()
    for argv, message in [(["--max-stored-responses", "0"], "--max-stored-responses"),
                          (["--response-store", str(tmp_path / "no" / "x.db")],
                           "--response-store: no such directory"),
                          (["--response-store", str(tmp_path)], "must name a file")]:
        with pytest.raises(ConfigError, match=message):
            ResponseStoreOptions.from_args(_args(*argv))
    path = tmp_path / "kept.sqlite"
    with response_store_file(ResponseStoreOptions.from_args(
            _args("--response-store", str(path)))) as options:
        assert options.path == str(path)
    assert path.exists()  # the user's file stays
