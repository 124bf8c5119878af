"""The reference pages under docs/reference/ against the code they describe.

* cli.md is what tools/gen_cli_reference.py writes from the argument parser now
  (the message says how to refresh it), names every `dpserve serve` flag, and has
  a section for every subcommand `dpserve --help` lists.
* http.md has a row for every (method, route) of the app `dpserve serve` builds
  with every optional router on, and none for a route the app lacks.
* metrics.md has a row for every `dpserve:*` series of that app's registry (name,
  type, labels), and for every series a module of dpserve defines by name.

The app is the real `build_app` over a real `AsyncLLM`, whose engine client
points at sockets where no engine ever comes: building it starts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
GENERATOR = ROOT / "tools" / "gen_cli_reference.py"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD")


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_cli_reference", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(page: str, heading: str) -> str:
    """The text under `heading` (a `## ` line) up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", page, re.M | re.S)
    assert match, f"cli.md has no '## {heading}' section"
    return match.group(1)


# -- cli.md -----------------------------------------------------------------------


def test_cli_page_is_what_the_parser_says() -> None:
    generator = _generator()
    page = (REFERENCE / "cli.md").read_text()
    assert generator.render() == page, (
        f"docs/reference/cli.md is stale: run `{generator.REFRESH}` and commit it")


def test_cli_page_names_every_serve_flag() -> None:
    from dpserve.entrypoints.serve import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    flags = [flag for action in parser._actions for flag in action.option_strings
             if flag not in ("-h", "--help")]
    assert len(flags) > 100, flags  # the premise: the whole parser, engine options too
    serve = _section((REFERENCE / "cli.md").read_text(), "dpserve serve")
    missing = [flag for flag in flags if f"`{flag}`" not in serve]
    assert not missing, f"docs/reference/cli.md lacks these `dpserve serve` flags: {missing}"


def test_cli_page_has_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    from dpserve.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    listed = re.search(r"\{([a-z,-]+)\}", capsys.readouterr().out)
    assert listed, "dpserve --help lists no subcommands"
    names = listed.group(1).split(",")
    assert {"serve", "generate", "bench"} <= set(names), names
    headings = re.findall(r"^## (dpserve .+)$", (REFERENCE / "cli.md").read_text(), re.M)
    for name in names:
        assert any(h == f"dpserve {name}" or h.startswith(f"dpserve {name} ")
                   for h in headings), f"docs/reference/cli.md has no section for {name}"


# -- the app: its routes and its metrics ------------------------------------------


def _walk(routes: list) -> list[tuple[str, frozenset[str]]]:
    """(path, methods) of every route, into included routers too (FastAPI >= 0.16x
    keeps an included router as one entry whose `effective_candidates()` are its
    routes)."""
    found = []
    for route in routes:
        if hasattr(route, "effective_candidates"):
            found += _walk(route.effective_candidates())
        elif hasattr(route, "original_route"):
            found.append((route.path, frozenset(route.original_route.methods)))
        else:
            found.append((route.path, frozenset(route.methods)))
    return found


async def _built(model: str, tmp: Path) -> tuple[list, list]:
    """Build the app `dpserve serve --enable-admin-api --state-dir TMP` builds, with
    prefill/decode roles too (their series): (its routes, its metric collectors)."""
    from dpserve.config import EngineArgs
    from dpserve.entrypoints.api_server import APIServerOptions
    from dpserve.entrypoints.serve import add_serve_args
    from dpserve.frontend.async_llm import AsyncLLM
    from dpserve.frontend.engine_client import AsyncEngineClient
    from dpserve.server.app import build_app

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    options = APIServerOptions.from_args(parser.parse_args(
        [model, "--enable-admin-api", "--state-dir", str(tmp)]))
    config = EngineArgs(model=model).create_config()
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, data_parallel_roles=(1, 1)))
    llm = AsyncLLM(config, AsyncEngineClient(f"ipc://{tmp}/in", f"ipc://{tmp}/out"))
    try:
        app = build_app(llm, options.served_model_name, enable_admin_api=True,
                        batches=options.batches)
        # prometheus_client keeps a metric's labels only on the metric object.
        return _walk(app.routes), list(app.state.metrics.registry._collector_to_names)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def app_parts(tiny_llama, tmp_path_factory) -> tuple[list, list]:
    return asyncio.run(_built(str(tiny_llama), tmp_path_factory.mktemp("state")))


def _page_routes() -> set[tuple[str, str]]:
    """(method, path) of every row of http.md's route tables."""
    rows = re.findall(r"^\| ((?:[A-Z]+, )*[A-Z]+) \| `([^`]+)` \|",
                      (REFERENCE / "http.md").read_text(), re.M)
    return {(method, path) for methods, path in rows for method in methods.split(", ")
            if method in METHODS}


def _app_routes(app_parts: tuple[list, list]) -> set[tuple[str, str]]:
    routes, _ = app_parts
    return {(method, re.sub(r"\{(\w+):\w+\}", r"{\1}", path))  # {id:path} -> {id}
            for path, methods in routes for method in methods}


def test_http_page_lists_every_route(app_parts) -> None:
    app = _app_routes(app_parts)
    # The premise: the admin, files, batches and FastAPI routes are all built.
    assert {("POST", "/pause"), ("POST", "/v1/batches"), ("GET", "/openapi.json"),
            ("POST", "/v1/messages"), ("POST", "/start_profile")} <= app, app
    missing = sorted(app - _page_routes())
    assert not missing, f"docs/reference/http.md has no row for these routes: {missing}"


def test_http_page_lists_no_route_the_app_lacks(app_parts) -> None:
    extra = sorted(_page_routes() - _app_routes(app_parts))
    assert not extra, f"docs/reference/http.md lists routes the app does not have: {extra}"


def _page_series() -> dict[str, tuple[str, tuple[str, ...]]]:
    """metrics.md's rows: scraped name -> (type, labels)."""
    rows = re.findall(r"^\| `(dpserve:[a-z0-9_]+)` \| (\w+) \|([^|]*)\|",
                      (REFERENCE / "metrics.md").read_text(), re.M)
    return {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def _scraped(name: str, kind: str) -> str:
    return name + "_total" if kind == "counter" else name


def test_metrics_page_lists_every_series(app_parts) -> None:
    _, collectors = app_parts
    app = {_scraped(c._name, c._type): (c._type, tuple(c._labelnames))
           for c in collectors if getattr(c, "_name", "").startswith("dpserve:")}
    # The premise: the tenant, prefill/decode, KV tier, LoRA and HTTP series are there.
    assert {"dpserve:tenant_requests_total", "dpserve:pd_handoffs_total",
            "dpserve:kv_offload_load_bytes_total", "dpserve:lora_adapter_loaded",
            "dpserve:http_responses_total"} <= set(app), sorted(app)
    page = _page_series()
    missing = sorted(set(app) - set(page))
    assert not missing, f"docs/reference/metrics.md has no row for these series: {missing}"
    wrong = {name: {"code": app[name], "page": page[name]} for name in app
             if page[name] != app[name]}
    assert not wrong, f"docs/reference/metrics.md has the wrong type or labels: {wrong}"
    extra = sorted(set(page) - set(app))
    assert not extra, f"docs/reference/metrics.md lists series the server lacks: {extra}"


def test_metrics_page_lists_every_series_defined_by_name() -> None:
    """A series a module names literally (a Counter, Gauge or Histogram made with the
    name, or a name -> help table) is on the page, wherever it is registered."""
    made = re.compile(r"(?:Counter|Gauge|Histogram|Summary)\(\s*\"(dpserve:[a-z0-9_]+)\"")
    table = re.compile(r"^\s*\"(dpserve:[a-z0-9_]+)\":", re.M)
    defined = {name for path in (ROOT / "dpserve").rglob("*.py")
               for pattern in (made, table) for name in pattern.findall(path.read_text())}
    assert "dpserve:request_success" in defined, defined  # the premise: the scan finds them
    page = {name.removesuffix("_total") for name in _page_series()}
    missing = sorted(defined - page)
    assert not missing, f"docs/reference/metrics.md has no row for these series: {missing}"
