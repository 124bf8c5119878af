"""Every route, body and option of the HTTP server against a hostile client.

* The route walk: an app built in-process with an API key and the admin API
  (`build_app` over a real `AsyncEngineClient` whose engines never come: no
  request here gets past the key) answers 401 for every route and method but
  the allowlist; /metrics behind `--metrics-auth`.
* A real `dpserve serve` with two keys from `--api-key-file`, the admin API and a
  small `--max-request-body-bytes`: both keys work, an oversized body gets 413 on
  every POST route and the server serves on, admin POSTs take only JSON (415),
  no CORS grant without --allowed-origins, dashboard headers, bounded ?timeout=.
* Command lines refused at start with one line (exit 2): the admin API without a
  key, credentials with a "*" origin, a world-readable key file.
* The tokenizer runs off the event loop: /version answers while a huge /tokenize
  is being tokenised (in-process, uvicorn on a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import Request
from helpers import free_port, output, serve, serve_app

from dpserve.server.batches.files_routes import MULTIPART_SLACK

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-9876543210"}
AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}
BODY_LIMIT = 4096
OPEN = {"/health", "/ping", "/version", "/metrics", "/dashboard", "/dashboard/{name}"}
PARAMS = {"rank": "0", "action": "cordon", "model_id": "tiny", "name": "dashboard.js",
          "response_id": "resp_x", "file_id": "file-x", "batch_id": "batch_x"}
UPLOAD_LIMIT = 1024  # --max-batch-file-bytes: /v1/files' own body cap (and the form's slack)
ADMIN_POSTS = ["/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache",
               "/engines/0/cordon", "/scale_elastic_ep"]


def _fill(path: str) -> str:
    """The path with plausible values for its parameters; fails on one not known here."""
    def value(match: re.Match) -> str:
        assert match.group(1) in PARAMS, f"no plausible value for {{{match.group(1)}}}: {path}"
        return PARAMS[match.group(1)]

    return re.sub(r"\{(\w+)(?::\w+)?\}", value, path)


def _is_openai_401(r: httpx.Response) -> bool:
    error = r.json()["error"]
    return (r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            and set(error) == {"message", "type", "param", "code"}
            and error["code"] == "invalid_api_key")


def _is_api_401(r: httpx.Response, path: str) -> bool:
    """The 401 in the shape of the route's API: Anthropic's on /v1/messages, else OpenAI's."""
    if not path.startswith("/v1/messages"):
        return _is_openai_401(r)
    body = r.json()
    return (r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            and body["type"] == "error" and body["error"]["type"] == "authentication_error")


def _routes(routes: list) -> Iterator[tuple[str, set[str]]]:
    """(path, methods) of every route, into included routers too (FastAPI >= 0.16x keeps
    an included router as one entry whose `effective_candidates()` are its routes)."""
    for route in routes:
        if hasattr(route, "effective_candidates"):
            yield from _routes(route.effective_candidates())
        elif hasattr(route, "original_route"):  # one route of an included router
            yield route.path, set(route.original_route.methods)
        else:
            assert isinstance(route.methods, set), f"a route of an unknown kind: {route!r}"
            yield route.path, route.methods


@contextlib.asynccontextmanager
async def _app(model: str, tmp: Path, auth: object):
    """`build_app` with the admin API over a real engine client whose engines never come."""
    from dpserve.config import EngineArgs
    from dpserve.frontend.async_llm import AsyncLLM
    from dpserve.frontend.engine_client import AsyncEngineClient
    from dpserve.server.app import build_app
    from dpserve.server.batches.options import BatchOptions

    config = EngineArgs(model=model).create_config()
    llm = AsyncLLM(config, AsyncEngineClient(f"ipc://{tmp}/in", f"ipc://{tmp}/out"))
    try:
        yield build_app(llm, "tiny", enable_admin_api=True, auth=auth,
                        batches=BatchOptions(state_dir=str(tmp)))
    finally:
        llm.shutdown()


async def _walk(model: str, tmp: Path, metrics_auth: bool) -> dict:
    """Build the app with a key and the admin API; every (method, route) -> what a
    client without the key, with a wrong key and with the key sans "Bearer" gets."""
    from dpserve.server.auth import AuthOptions

    auth = AuthOptions.from_key(KEYS["alice"], metrics_auth=metrics_auth)
    async with _app(model, tmp, auth) as app:
        seen: dict = {}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            for route_path, methods in _routes(app.routes):
                for method in sorted(methods):
                    path = _fill(route_path)
                    seen[method, route_path] = [await http.request(
                        method, path, headers=headers, json={} if method == "POST" else None)
                        for headers in ({}, {"Authorization": "Bearer wrong"},
                                        {"Authorization": KEYS["alice"]},  # no "Bearer"
                                        {"x-api-key": "wrong"})]
        return seen


def test_every_route_needs_the_key_but_the_allowlist(tiny_llama, tmp_path) -> None:
    seen = asyncio.run(_walk(str(tiny_llama), tmp_path, metrics_auth=False))
    routes = {path for _, path in seen}
    # The premise: the admin, control, scale, extra and FastAPI routes are all there.
    assert {"/pause", "/is_sleeping", "/engines/{rank}/{action}", "/scale_elastic_ep",
            "/tokenize", "/debug/dp_state", "/engines", "/openapi.json",
            "/v1/chat/completions", "/v1/messages"} <= routes, routes
    assert not routes & {"/docs", "/redoc"}  # they load scripts from a CDN: gone
    assert OPEN <= routes
    for (method, path), answers in seen.items():
        if path in OPEN:
            assert all(r.status_code != 401 for r in answers), (method, path, answers)
            continue
        for r in answers:  # no key, a wrong key, the key without "Bearer ", a wrong x-api-key
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert method == "HEAD" or _is_api_401(r, path), (method, path, r.text)


def test_metrics_auth_puts_metrics_behind_the_key(tiny_llama, tmp_path) -> None:
    seen = asyncio.run(_walk(str(tiny_llama), tmp_path, metrics_auth=True))
    assert [r.status_code for r in seen["GET", "/metrics"]] == [401] * 4
    assert seen["GET", "/version"][0].status_code == 200


def test_key_ids_are_names_or_hashes_never_the_key(tmp_path) -> None:
    from dpserve.server.auth import AuthOptions, key_id, load_key_file

    path = tmp_path / "keys"
    path.write_text(f"# operators\n\nalice {KEYS['alice']}\n  {KEYS['bob']}  \n"
                    "an-unnamed-key-too\n")
    path.chmod(0o600)
    auth = AuthOptions(tuple(load_key_file(str(path))))
    assert auth.match("Bearer an-unnamed-key-too") == key_id("an-unnamed-key-too")
    assert auth.match(f"Bearer {KEYS['alice']}") == "alice"
    assert auth.match(f"bearer {KEYS['bob']}") == key_id(KEYS["bob"]) == (
        "key-" + hashlib.sha256(KEYS["bob"].encode()).hexdigest()[:12])
    assert auth.match("Bearer alice") is None and auth.match(KEYS["alice"]) is None


def test_the_matched_key_id_reaches_the_route(tiny_llama, tmp_path) -> None:
    """`request.state.api_key_id` (per-key prefix-cache salting reads it): the key's
    name, or key-<sha256 prefix>; None without keys; never the key itself."""
    from dpserve.server.auth import APIKey, AuthOptions, key_id

    named = AuthOptions((APIKey("alice", hashlib.sha256(KEYS["alice"].encode()).digest()),
                         *AuthOptions.from_key(KEYS["bob"]).keys))

    async def ids(auth: AuthOptions, keys: list[str | None]) -> list[object]:
        async with _app(str(tiny_llama), tmp_path, auth) as app:
            @app.get("/who")  # a route added after build_app: behind the key all the same
            async def who(request: Request) -> dict:
                return {"id": request.state.api_key_id}

            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://app") as http:
                answers = [await http.get("/who", headers={"Authorization": f"Bearer {k}"}
                                          if k else {}) for k in keys]
        return [r.json().get("id", r.status_code) for r in answers]

    assert asyncio.run(ids(named, [KEYS["alice"], KEYS["bob"], None, "x"])) == [
        "alice", key_id(KEYS["bob"]), 401, 401]
    assert asyncio.run(ids(AuthOptions(), [None])) == [None]


# ---- one real server: two keys, the admin API, a small body limit ----------------------


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# two operators\n" + "".join(f"{n} {k}\n" for n, k in KEYS.items()))
    keys.chmod(0o600)
    with serve(str(tiny_llama), "--served-model-name", "tiny", "--api-key-file", str(keys),
               "--enable-admin-api", "--max-request-body-bytes", str(BODY_LIMIT),
               "--max-batch-file-bytes", str(UPLOAD_LIMIT),
               "--max-model-len", "256", "--threads-per-engine", "1") as (proc, url):
        yield proc, url


def _complete(url: str, key: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    return client.completions.create(model="tiny", prompt="Hello", max_tokens=3,
                                     temperature=0).choices[0].text


def test_both_keys_of_the_key_file_are_accepted(server) -> None:
    _, url = server
    assert _complete(url, KEYS["alice"]) == _complete(url, KEYS["bob"])
    with pytest.raises(openai.AuthenticationError):
        _complete(url, "mallory")
    assert httpx.get(url + "/engines", timeout=10).status_code == 401
    assert httpx.get(url + "/engines", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(url + "/ping", timeout=10).status_code == 200
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200  # open by default
    assert httpx.get(url + "/docs", headers=AUTH, timeout=10).status_code == 404
    assert httpx.get(url + "/openapi.json", headers=AUTH, timeout=10).status_code == 200


def _post_routes(url: str) -> list[str]:
    """Every POST route of the server's own table (/openapi.json), paths filled in."""
    spec = httpx.get(url + "/openapi.json", headers=AUTH, timeout=10).json()
    return [_fill(path) for path, ops in spec["paths"].items() if "post" in ops]


def test_an_oversized_body_gets_413_on_every_post_route(server) -> None:
    proc, url = server
    posts = _post_routes(url)
    assert {"/v1/completions", "/tokenize", "/detokenize", "/scale_elastic_ep",
            "/pause", "/engines/0/cordon", "/v1/files"} <= set(posts), posts
    big = b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'
    for path in posts:
        # The upload route's own cap: --max-batch-file-bytes and the form's slack.
        flag, limit = (("--max-batch-file-bytes", UPLOAD_LIMIT + MULTIPART_SLACK)
                       if path == "/v1/files" else ("--max-request-body-bytes", BODY_LIMIT))
        r = httpx.post(url + path, content=big + b" " * (limit - BODY_LIMIT), timeout=30,
                       headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 413, (path, r.status_code, r.text)
        error = r.json()["error"]
        assert f"{flag} ({limit} bytes)" in error["message"], error

    def chunks():  # no Content-Length: counted as the route reads it
        for _ in range(8):
            yield b"x" * 1024

    for path in ("/v1/completions", "/tokenize", "/scale_elastic_ep"):
        r = httpx.post(url + path, content=chunks(), timeout=30,
                       headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 413, (path, r.status_code, r.text)
    assert _complete(url, KEYS["bob"]), output(proc)[-3000:]
    assert proc.poll() is None


def test_admin_posts_take_only_json(server) -> None:
    _, url = server
    for path in ADMIN_POSTS:
        for headers, body in (({}, b""), ({"Content-Type": "text/plain"}, b"{}"),
                              ({"Content-Type": "application/x-www-form-urlencoded"}, b"a=1")):
            r = httpx.post(url + path, content=body, headers={**AUTH, **headers}, timeout=30)
            assert r.status_code == 415, (path, headers, r.status_code, r.text)
            assert "application/json" in r.json()["error"]["message"]
    assert httpx.get(url + "/is_paused", headers=AUTH, timeout=10).json() == {
        "is_paused": False}  # none of them ran
    r = httpx.post(url + "/reset_prefix_cache", json={}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


def test_no_cors_grant_without_allowed_origins(server) -> None:
    _, url = server
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    for path in ("/pause", "/scale_elastic_ep", "/v1/completions"):
        r = httpx.options(url + path, headers=preflight, timeout=10)
        assert not any(h.startswith("access-control-") for h in r.headers), (path, r.headers)
    r = httpx.get(url + "/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e9", "3601", "soon"])
def test_timeouts_are_finite_positive_and_capped(server, value) -> None:
    _, url = server
    for path in ("/pause", "/sleep", "/engines/0/drain"):
        r = httpx.post(url + path, params={"timeout": value}, json={}, headers=AUTH,
                       timeout=30)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "timeout" and "(0, 3600]" in error["message"], error
    assert httpx.get(url + "/is_paused", headers=AUTH, timeout=10).json()["is_paused"] is False


def test_dashboard_headers_and_relative_urls(server) -> None:
    _, url = server
    for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"):
        r = httpx.get(url + path, timeout=10)  # open: no data in them
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "style-src 'self'" in csp
        assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["referrer-policy"] == "no-referrer"
    html = httpx.get(url + "/dashboard", timeout=10).text
    js = httpx.get(url + "/dashboard/dashboard.js", timeout=10).text
    assert not re.search(r'(src|href)="/', html) and "<script>" not in html
    assert 'src="dashboard/dashboard.js"' in html
    assert not re.search(r'(fetch|post)\("/', js) and 'fetch("engines"' in js


# ---- command lines refused at start ----------------------------------------------------


def _refused(model: str, *args: str, env: dict | None = None) -> str:
    """Run `dpserve serve` that must fail at once: its one stderr line."""
    out = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", model, "--port",
                          str(free_port()), *args], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **(env or {})})
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpserve: error: "), out.stderr
    return lines[0]


def test_bad_command_lines_are_refused_with_one_line(tiny_llama, tmp_path) -> None:
    model = str(tiny_llama)
    env = {"DPSERVE_API_KEY": ""}
    assert "--api-key" in _refused(model, "--enable-admin-api", env=env)
    line = _refused(model, "--enable-admin-api", "--allow-unauthenticated-admin",
                    "--host", "0.0.0.0", env=env)
    assert "--allow-unauthenticated-admin" in line and "loopback" in line
    line = _refused(model, "--allowed-origins", '["*"]', "--allow-credentials")
    assert "--allow-credentials" in line and "'*'" in line
    assert "--allowed-origins" in _refused(model, "--allow-credentials")
    assert "--metrics-auth" in _refused(model, "--metrics-auth", env=env)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEYS['alice']}\n")
    keys.chmod(0o644)
    line = _refused(model, "--api-key-file", str(keys))
    assert "--api-key-file" in line and "0644" in line and "chmod 600" in line
    keys.chmod(0o600)
    keys.write_text("a b c\n")
    assert "line 1" in _refused(model, "--api-key-file", str(keys))


# ---- the tokenizer thread ------------------------------------------------------------


def test_a_huge_tokenize_does_not_stall_other_clients(tiny_llama) -> None:
    """While /tokenize works on a ~4 MB prompt (seconds of tokenising), the event loop
    answers other clients: /version answers arrive before the /tokenize answer."""
    prompt = "the quick brown fox jumps over the lazy dog " * 90_000
    with _in_process(tiny_llama, max_request_body_bytes=8 << 20) as url:
        done = threading.Event()
        answered_meanwhile: list[int] = []
        answer: list[httpx.Response] = []

        def tokenize() -> None:
            try:
                answer.append(httpx.post(url + "/tokenize", json={"prompt": prompt},
                                         timeout=120))
            finally:
                done.set()

        worker = threading.Thread(target=tokenize)
        worker.start()
        with httpx.Client(base_url=url, timeout=60) as http:
            while not done.is_set():
                status = http.get("/version").status_code
                if not done.is_set():
                    answered_meanwhile.append(status)
                time.sleep(0.02)
        worker.join(120)
        assert answer and answer[0].status_code == 200, answer
        assert answer[0].json()["count"] > 500_000  # seconds of work for the tokenizer
        assert answered_meanwhile.count(200) >= 3, answered_meanwhile


@contextlib.contextmanager
def _in_process(model: Path, **app_kw: object) -> Iterator[str]:
    """uvicorn on a thread serving `build_app` over one in-process engine; its URL."""
    from dpserve.config import EngineArgs
    from dpserve.frontend.async_llm import AsyncLLM
    from dpserve.server.app import build_app
    from dpserve.testing.inproc_client import InprocEngineClient

    config = EngineArgs(model=str(model), num_kv_blocks=64).create_config()
    llm = AsyncLLM(config, InprocEngineClient(config))
    with serve_app(build_app(llm, "tiny", **app_kw), stop_first=llm.shutdown) as (url, _):
        yield url


def test_serving_reports_the_tokenize_result_unchanged(server) -> None:
    _, url = server
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}, headers=AUTH,
                   timeout=30).json()
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, headers=AUTH,
                      timeout=30).json()
    assert back == {"prompt": "Hello world"}
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                      headers=AUTH, timeout=30)
    assert chat.status_code == 200 and chat.json()["count"] > 0
