"""How tests/docs_blocks.py reads the docs' test markers (nothing is run here).

The sample page tests/docs_sample.md holds each kind of block; every page of the
repository must parse too, so a marker mistake fails here in milliseconds rather
than in the run (tests/server/test_docs_examples.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_blocks import (
    SERVER_TIMEOUT_S,
    DocBlockError,
    client_code,
    needs_server,
    parse,
    server_argv,
)

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests" / "docs_sample.md"


def doc_pages() -> list[Path]:
    """The pages whose marked blocks run: README.md and the other top-level pages, and
    every page under docs/."""
    return sorted([*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md")])


def test_sample_blocks_in_order() -> None:
    blocks = parse(SAMPLE.read_text(), "sample.md")
    assert [(b.action, b.lang) for b in blocks] == [
        ("run", "python"), ("server", "bash"), ("run", "bash"), ("run", "bash"),
        ("run", "python"), ("skip", "bash")]
    lines = SAMPLE.read_text().splitlines()
    assert all(lines[b.line - 1].lstrip().startswith("```") for b in blocks)
    assert blocks[0].timeout == 60 and blocks[1].timeout == SERVER_TIMEOUT_S
    assert not any("unmarked" in b.code or "quoted" in b.code for b in blocks)


def test_an_indented_block_is_dedented_to_its_fence() -> None:
    tab = parse(SAMPLE.read_text(), "sample.md")[4]
    assert tab.code.startswith("import os\n")
    compile(tab.code, "tab", "exec")  # its own indentation kept: it is valid Python


@pytest.mark.parametrize("page,message", [
    ("<!-- test: run -->\nSome prose.\n```bash\ntrue\n```\n", "right before a code block"),
    ("text\n<!-- test: run -->\n", "no code block"),
    ("<!-- test: run -->\n<!-- test: run -->\n```bash\ntrue\n```\n", "no code block"),
    ("<!-- test: runn -->\n```bash\ntrue\n```\n", "unknown test action"),
    ("<!-- test: run retries=2 -->\n```bash\ntrue\n```\n", "unknown test option"),
    ("<!-- test: run -->\n```text\ntrue\n```\n", "must be one of"),
    ("<!-- test: run -->\n```\ntrue\n```\n", "must be one of"),
    ("<!-- test: server -->\n```python\nprint()\n```\n", "must be one of: bash"),
])
def test_a_bad_marker_is_an_error(page: str, message: str) -> None:
    with pytest.raises(DocBlockError, match=message):
        parse(page, "bad.md")


def test_the_address_is_rewritten() -> None:
    code = ("curl http://127.0.0.1:8000/v1/models localhost:8000/health "
            "0.0.0.0:8000 127.0.0.1:80001 127.0.0.1:18000\n")
    assert needs_server(code) and not needs_server("curl 127.0.0.1:18000\n")
    assert client_code(code, 4321) == (
        "curl http://127.0.0.1:4321/v1/models 127.0.0.1:4321/health "
        "127.0.0.1:4321 127.0.0.1:80001 127.0.0.1:18000\n")


@pytest.mark.parametrize("code,expected", [
    ("dpserve serve --host 0.0.0.0 --port 8000 -dp 2   # a comment\n",
     ["dpserve", "serve", "-dp", "2"]),
    ("# start it:\n.venv/bin/dpserve serve MODEL --port=8000 \\\n    --max-model-len 512\n",
     [".venv/bin/dpserve", "serve", "MODEL", "--max-model-len", "512"]),
    ("python -m dpserve serve\n", ["python", "-m", "dpserve", "serve"]),
])
def test_a_server_listens_where_the_test_says(code: str, expected: list[str]) -> None:
    argv = server_argv(code, 4321, ROOT, {})
    assert argv == [*expected, "--host", "127.0.0.1", "--port", "4321"]


def test_a_server_block_without_a_server_is_an_error() -> None:
    with pytest.raises(DocBlockError, match="no `dpserve serve`"):
        server_argv("dpserve generate --prompt hi\n", 4321, ROOT, {})


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_parses(page: Path) -> None:
    parse(page.read_text(), str(page.relative_to(ROOT)))
