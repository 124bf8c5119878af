"""/v1/files and /v1/batches with the official `openai` client against one real
server (`--data-parallel-size 2 --api-server-count 2`, tiny random model, a
`--state-dir` the tests read too), and `dpserve run-batch` offline.

Checked: a chat batch and a completions batch run to completion, each line's
answer equal to the endpoint's greedy answer for the same body, a refused line in
the error file, each batch run by one API server; cancel; list; the 404s, 400s and
413s; a bad input file failing validation with errors naming its lines;
/v1/embeddings lines answered with error lines (no such endpoint yet); a batch
holding its lines while an engine has a request waiting (its own server,
--max-num-seqs 1); a batch surviving SIGTERM and a restart on the same
--state-dir with every line answered exactly once (its own server, twice);
run-batch on a small file (the same answers as the server's).
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from helpers import metric_sum, output, serve, wait_until

from dpserve.server.batches.files_routes import MULTIPART_SLACK

pytestmark = [pytest.mark.procs]

MAX_FILE = 60000
PROMPTS = ["Tell me about Oslo.", "Name a colour.", "Count to three.", "Hello there"]
CHAT = {"temperature": 0, "max_tokens": 8}
SERVER_ARGS = ("--threads-per-engine", "1", "--max-model-len", "1024",
               "--max-batch-file-bytes", str(MAX_FILE), "--max-batch-concurrency", "2")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    model, state = str(tiny_llama), tmp_path_factory.mktemp("state")
    with serve(model, "--data-parallel-size", "2", "--api-server-count", "2",
               "--state-dir", str(state), *SERVER_ARGS, timeout=180) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        yield proc, client, model, state


def _line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _upload(client: openai.OpenAI, lines: list[dict | str], name: str = "in.jsonl"):
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return client.files.create(file=(name, text.encode()), purpose="batch")


def _finished(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in (
        "completed", "failed", "cancelled") and b, timeout, f"batch {batch_id} to end")


def _results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    """custom_id -> output line (each custom_id once)."""
    if file_id is None:
        return {}
    lines = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    by_id = {x["custom_id"]: x for x in lines}
    assert len(by_id) == len(lines), "a custom_id answered twice"
    return by_id


def _runners(state: Path, batch_id: str) -> dict[str, int]:
    """The server's record: API server -> lines it answered for `batch_id`."""
    with sqlite3.connect(state / "batches.sqlite") as db:
        return dict(db.execute("SELECT runner, COUNT(*) FROM batch_lines WHERE batch_id = ? "
                               "GROUP BY runner", (batch_id,)).fetchall())


def test_chat_and_completion_batches_answer_as_the_endpoints(server) -> None:
    _, client, model, state = server
    chat_lines = [_line(f"c{i}", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": p}], **CHAT})
        for i, p in enumerate(PROMPTS)]
    chat_lines.append(_line("bad-model", "/v1/chat/completions", {
        "model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}))
    completion_lines = [_line(f"p{i}", "/v1/completions", {
        "model": model, "prompt": p, **CHAT}) for i, p in enumerate(PROMPTS)]
    chat_file, completion_file = _upload(client, chat_lines), _upload(client, completion_lines)
    assert chat_file.purpose == "batch" and chat_file.filename == "in.jsonl"
    batches = [client.batches.create(input_file_id=f.id, endpoint=endpoint,
                                     completion_window="24h", metadata={"case": "a"})
               for f, endpoint in ((chat_file, "/v1/chat/completions"),
                                   (completion_file, "/v1/completions"))]
    assert all(b.status == "validating" and b.metadata == {"case": "a"} for b in batches)
    chat_batch, completion_batch = (_finished(client, b.id) for b in batches)
    assert chat_batch.status == completion_batch.status == "completed"
    assert chat_batch.request_counts.model_dump() == {"total": 5, "completed": 4, "failed": 1}
    assert completion_batch.request_counts.model_dump() == {
        "total": 4, "completed": 4, "failed": 0}
    assert completion_batch.error_file_id is None
    chat_out = _results(client, chat_batch.output_file_id)
    completion_out = _results(client, completion_batch.output_file_id)
    for i, p in enumerate(PROMPTS):
        direct = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], **CHAT)
        line = chat_out[f"c{i}"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        body = line["response"]["body"]
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert line["response"]["request_id"] == body["id"]
        direct = client.completions.create(model=model, prompt=p, **CHAT)
        assert completion_out[f"p{i}"]["response"]["body"]["choices"][0]["text"] == \
            direct.choices[0].text
    (refused,) = _results(client, chat_batch.error_file_id).values()
    assert refused["custom_id"] == "bad-model"
    assert refused["response"]["status_code"] == 404
    assert refused["response"]["body"]["error"]["param"] == "model"
    # One API server ran each batch (its lease), whichever did.
    assert [sum(_runners(state, b.id).values()) for b in batches] == [5, 4]
    assert all(len(_runners(state, b.id)) == 1 for b in batches)
    # Listed, newest first; the result files are files too.
    listed = [b.id for b in client.batches.list(limit=2).data]
    assert listed == [completion_batch.id, chat_batch.id]
    files = {f.id: f for f in client.files.list().data}
    assert files[chat_batch.output_file_id].purpose == "batch_output"
    assert chat_file.id in files


def test_bad_input_file_fails_validation_naming_lines(server) -> None:
    _, client, model, _ = server
    good = _line("a", "/v1/completions", {"model": model, "prompt": "Hi", **CHAT})
    bad = _upload(client, [good, "{not json", _line("b", "/v1/images/generations", {})])
    batch = client.batches.create(input_file_id=bad.id, endpoint="/v1/completions",
                                  completion_window="24h")
    failed = _finished(client, batch.id)
    assert failed.status == "failed" and failed.failed_at is not None
    assert [(e.line, e.code, e.param) for e in failed.errors.data] == [
        (2, "invalid_json_line", None), (3, "invalid_url", "url")]
    assert failed.output_file_id is None and failed.request_counts.completed == 0


def test_embeddings_lines_equal_the_endpoints_vectors(server) -> None:
    _, client, model, _ = server
    texts = ["Hi", "A longer text to embed."]
    f = _upload(client, [_line(f"e{i}", "/v1/embeddings", {"model": model, "input": t})
                         for i, t in enumerate(texts)])
    batch = _finished(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert batch.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}
    lines = _results(client, batch.output_file_id)
    for i, text in enumerate(texts):
        direct = client.embeddings.create(model=model, input=text, encoding_format="float")
        body = lines[f"e{i}"]["response"]["body"]
        # equal to float32 rounding: each request's steps hold other inputs too
        np.testing.assert_allclose(body["data"][0]["embedding"], direct.data[0].embedding,
                                   rtol=0, atol=1e-5)


def test_unknown_ids_bad_fields_and_oversized_files(server) -> None:
    _, client, model, _ = server
    for call in (lambda: client.batches.retrieve("batch_nope"),
                 lambda: client.batches.cancel("batch_nope"),
                 lambda: client.files.retrieve("file-nope"),
                 lambda: client.files.content("file-nope"),
                 lambda: client.files.delete("file-nope"),
                 lambda: client.batches.create(input_file_id="file-nope",
                                               endpoint="/v1/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    good = _upload(client, [_line("a", "/v1/completions", {"model": model, "prompt": "x"})])
    for fields, param in (({"endpoint": "/v1/moderations"}, "endpoint"),
                          ({"completion_window": "1h"}, "completion_window"),
                          ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 64)):
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(**{"input_file_id": good.id, "endpoint": "/v1/completions",
                                     "completion_window": "24h", **fields})
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    # Over the limit: by a byte (the upload's own count), and far over (Content-Length).
    for size in (MAX_FILE + 1, MAX_FILE + MULTIPART_SLACK + 1000):
        with pytest.raises(openai.APIStatusError) as e:
            client.files.create(file=("big.jsonl", b"x" * size), purpose="batch")
        assert e.value.status_code == 413 and "--max-batch-file-bytes" in e.value.message
    assert client.files.delete(good.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(good.id)


def test_cancel_stops_a_batch_in_flight(server) -> None:
    _, client, model, state = server
    lines = [_line(f"r{i}", "/v1/completions", {
        "model": model, "prompt": PROMPTS[i % 4], "max_tokens": 200, "ignore_eos": True,
        "temperature": 0}) for i in range(40)]
    batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                  endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 120,
               "a line answered")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    cancelled = _finished(client, batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    counts = cancelled.request_counts
    assert 1 <= counts.completed < 40 and counts.failed == 0  # premise: cut short
    answered = _results(client, cancelled.output_file_id)
    assert len(answered) == counts.completed and set(answered) <= {f"r{i}" for i in range(40)}
    assert sum(_runners(state, batch.id).values()) == counts.completed
    with pytest.raises(openai.APIStatusError) as e:  # over: nothing to cancel
        client.batches.cancel(batch.id)
    assert e.value.status_code == 409


def test_batch_yields_to_waiting_requests(tiny_llama) -> None:
    """One request running and one waiting (--max-num-seqs 1): the batch starts no line
    until they are gone, then completes."""
    model = str(tiny_llama)
    lines = [_line(f"r{i}", "/v1/completions", {"model": model, "prompt": p, **CHAT})
             for i, p in enumerate(PROMPTS[:2])]
    with serve(model, "--max-num-seqs", "1", *SERVER_ARGS) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        long = dict(model=model, prompt="Once", max_tokens=900, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
        running = client.completions.create(**long)
        next(iter(running))  # it runs: the next one waits
        waiting = client.completions.create(**long)
        batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                      endpoint="/v1/completions", completion_window="24h")
        wait_until(lambda: f"batch {batch.id}: holding" in output(proc), 60, "the hold")
        assert client.batches.retrieve(batch.id).request_counts.completed == 0
        assert metric_sum(url, "dpserve:num_requests_waiting") >= 1  # premise: still waiting
        running.close()  # both leave (aborted): the engine is free
        waiting.close()
        assert _finished(client, batch.id).request_counts.completed == 2


@pytest.mark.slow
def test_batch_survives_sigterm_and_restart(tiny_llama, tmp_path) -> None:
    """SIGTERM mid-batch, then a new server on the same --state-dir: the batch goes on
    where it stopped, and every line is answered exactly once."""
    model, state = str(tiny_llama), tmp_path / "state"
    args = ("--data-parallel-size", "2", "--api-server-count", "2", "--state-dir", str(state),
            *SERVER_ARGS)
    lines = [_line(f"r{i}", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": PROMPTS[i % 4]}],
        "max_tokens": 96, "ignore_eos": True, "temperature": 0}) for i in range(24)]
    with serve(model, *args, timeout=180) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3,
                   120, "three lines answered")
        proc.terminate()
        assert proc.wait(60) == 0, output(proc)[-3000:]
        assert re.search(rf"batch {batch.id}: .* \(stopped\)", output(proc))  # its runner's
    first = _runners(state, batch.id)
    assert len(first) == 1 and 3 <= sum(first.values()) < 24, first  # premise: mid-batch
    with sqlite3.connect(state / "batches.sqlite") as db:
        status, owner = db.execute("SELECT status, owner FROM batches WHERE id = ?",
                                   (batch.id,)).fetchone()
    assert status == "in_progress" and owner is None  # the lease was given back
    with serve(model, *args, timeout=180) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        done = _finished(client, batch.id)
        assert done.status == "completed"
        # This server ran only the lines the first had not answered, each once.
        assert metric_sum(url, "dpserve:request_success_total") == 24 - sum(first.values())
        assert done.request_counts.model_dump() == {"total": 24, "completed": 24, "failed": 0}
        results = _results(client, done.output_file_id)  # no custom_id twice
        assert set(results) == {f"r{i}" for i in range(24)}  # none missing
        expected = {p: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_tokens=96,
            temperature=0, extra_body={"ignore_eos": True}).choices[0].message.content
            for p in PROMPTS}
    for i in range(24):
        body = results[f"r{i}"]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == expected[PROMPTS[i % 4]]
    after = _runners(state, batch.id)
    assert sum(after.values()) == 24 and len(after) == 2
    (runner,) = first
    assert after[runner] == first[runner]  # the first run's lines were not run again


def test_run_batch_offline(server, tmp_path) -> None:
    _, client, model, _ = server
    lines = [_line("c0", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], **CHAT}),
        _line("p0", "/v1/completions", {"model": model, "prompt": PROMPTS[1], **CHAT}),
        _line("tools", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "tools": []}),
        _line("c1", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": PROMPTS[2]}], **CHAT})]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = subprocess.run([sys.executable, "-m", "dpserve.cli", "run-batch", model, "-i",
                          str(src), "-o", str(dst), "--threads-per-engine", "1",
                          "--max-model-len", "1024"], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "3/3" in run.stderr  # the progress bar reached its end
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["c0", "p0", "tools", "c1"]
    chat = [client.chat.completions.create(model=model, messages=[
        {"role": "user", "content": p}], **CHAT).choices[0].message.content
        for p in (PROMPTS[0], PROMPTS[2])]
    assert [out[i]["response"]["body"]["choices"][0]["message"]["content"]
            for i in (0, 3)] == chat
    assert out[1]["response"]["body"]["choices"][0]["text"] == client.completions.create(
        model=model, prompt=PROMPTS[1], **CHAT).choices[0].text
    assert out[2]["response"]["status_code"] == 400
    assert out[2]["response"]["body"]["error"]["param"] == "tools"
    # A bad file: one line naming the line, exit 2, before any model loads.
    src.write_text(json.dumps(lines[0]) + "\n{oops\n")
    bad = subprocess.run([sys.executable, "-m", "dpserve.cli", "run-batch", model, "-i",
                          str(src), "-o", str(dst)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith(
        f"dpserve: error: --input-file {src} line 2: line 2 is not valid JSON")


def test_state_dir_holds_files_private(server) -> None:
    _, client, _, state = server
    f = _upload(client, ["{}"])
    path = state / "files" / f.id
    assert path.read_text() == "{}\n"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct((state / "files").stat().st_mode & 0o777) == "0o700"
