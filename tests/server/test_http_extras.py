"""The smaller OpenAI / vLLM surface of `dpserve serve`: CORS, several served model
names, /v1/models/{id}, --chat-template, /tokenize + /detokenize, HTTP responses in
/metrics (no *_created series), --root-path, TLS with a self-signed certificate,
`python -m dpserve --version`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import free_port, serve, stop

pytestmark = pytest.mark.procs

ORIGIN = "https://app.example"
TEMPLATE = ("{% for m in messages %}CUSTOM {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}CUSTOM assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with serve(str(tiny_llama), "--served-model-name", "tiny", "alias2",
               "--allowed-origins", f'["{ORIGIN}"]', "--chat-template", str(template),
               "--root-path", "/api") as (_, url):
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_cors_preflight(server) -> None:
    url, _ = server
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "content-type,authorization"}
    r = httpx.options(url + "/v1/chat/completions", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(url + "/v1/chat/completions", headers={**headers, "Origin": "https://evil"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(url + "/v1/models", headers={"Origin": "https://evil"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_served_model_names_and_model_route(server) -> None:
    _, client = server
    assert [m.id for m in client.models.list().data] == ["tiny", "alias2"]
    assert client.models.retrieve("alias2").id == "alias2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    out = client.completions.create(model="alias2", prompt="Hello", max_tokens=3)
    assert out.choices[0].text is not None


def test_tokenize_detokenize_and_the_chat_template(server) -> None:
    url, _ = server
    r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "Hello world",
                                            "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) > 0
    assert r["max_model_len"] > 0
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    chat = httpx.post(url + "/tokenize", json={
        "messages": [{"role": "user", "content": "Hi"}]}).json()
    text = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text == "CUSTOM user: Hi\nCUSTOM assistant:"  # --chat-template, not the model's
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/tokenize", json={"prompt": "x", "model": "no"}).status_code == 404


def test_http_responses_in_metrics(server) -> None:
    url, client = server
    client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    httpx.get(url + "/v1/models/nope")
    text = httpx.get(url + "/metrics").text
    assert re.search(r'^dpserve:http_responses_total\{route="/v1/completions",status="200"\} '
                     r'[1-9]', text, re.M), text
    assert re.search(r'^dpserve:http_responses_total\{route="/v1/models/\{model_id:path\}",'
                     r'status="404"\} [1-9]', text, re.M)
    assert "_created" not in text


def test_root_path(server) -> None:
    """Behind a proxy that strips /api: routes answer as usual, and the app's own links
    (the OpenAPI servers list) carry the prefix."""
    url, _ = server
    assert httpx.get(url + "/v1/models").status_code == 200
    assert httpx.get(url + "/openapi.json").json()["servers"] == [{"url": "/api"}]
    # The dashboard's URLs are relative: a browser at <proxy>/api/dashboard loads
    # /api/dashboard/dashboard.js and polls /api/engines, which the proxy strips.
    html = httpx.get(url + "/dashboard").text
    assert 'src="dashboard/dashboard.js"' in html and 'href="dashboard/dashboard.css"' in html
    js = httpx.get(url + "/dashboard/dashboard.js").text
    assert 'fetch("engines"' in js and 'fetch("/' not in js


def test_python_m_dpserve_version() -> None:
    out = subprocess.run([sys.executable, "-m", "dpserve", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and re.fullmatch(r"dpserve \d+\.\d+\.\d+\n", out.stdout)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_a_self_signed_certificate(tiny_llama, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpserve", "serve", str(tiny_llama), "--port", str(port),
         "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "no HTTPS /health"
            try:
                if httpx.get(url + "/health", verify=str(cert), timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=str(cert)))
        assert client.completions.create(model=client.models.list().data[0].id,
                                         prompt="Hi", max_tokens=2).choices
        with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
            httpx.get(url + "/health", timeout=5)
        with pytest.raises(httpx.HTTPError):  # and no plain HTTP
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        stop(proc)
        log.close()


def test_logit_bias_echo_and_cached_tokens(server) -> None:
    url, client = server
    token = httpx.post(url + "/tokenize", json={"prompt": " fox"}).json()["tokens"][-1]
    forced = httpx.post(url + "/detokenize", json={"tokens": [token] * 4}).json()["prompt"]
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                    logit_bias={str(token): 100})
    assert out.choices[0].text == forced
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                    logit_bias={str(token): -100})
    assert " fox" not in out.choices[0].text
    out = client.completions.create(model="tiny", prompt=["Hello", "Once upon"], max_tokens=3,
                                    echo=True, n=2)
    assert [c.text[:5] for c in out.choices] == ["Hello", "Hello", "Once ", "Once "]
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices).startswith("Hello")
    prompt = "Data parallel serving runs several replicas of one model. " * 3
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16  # a whole block or more
