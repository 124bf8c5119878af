"""The docs' marked code blocks run, and pass (tests/docs_blocks.py has the markers).

First the harness on its own sample page (tests/docs_sample.md) and on blocks
made to fail, so a failing block is known to fail the test; then every marked
block of README.md, the other top-level pages and docs/**/*.md, against real
servers: the quick start's `make serve` (started once, shared by every page that
needs it) or a page's own `<!-- test: server -->` block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_blocks import DocBlockError, Runner, parse, server_argv

pytestmark = [pytest.mark.procs, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests" / "docs_sample.md"


def marked_pages() -> list[Path]:
    """The repository's pages with a block to run (or a marker mistake: its test fails)."""
    def runs(page: Path) -> bool:
        try:
            return any(b.action != "skip" for b in parse(page.read_text(), page.name))
        except DocBlockError:
            return True

    return [p for p in sorted([*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md")]) if runs(p)]


@pytest.fixture(scope="module")
def runner():
    runner = Runner(ROOT)
    yield runner
    runner.close()


@pytest.mark.slow
def test_the_sample_page_runs_its_marked_blocks(tmp_path: Path) -> None:
    out = tmp_path / "ran.txt"
    runner = Runner(ROOT, env={"DOCS_SAMPLE_OUT": str(out)})
    try:
        runner.run_page(parse(SAMPLE.read_text(), "docs_sample.md"))
    finally:
        runner.close()
    assert out.read_text().split() == ["python", "curl", "blank", "openai"]
    assert runner.default is None  # the page's own server answered: no `make serve`


def _run(page: str) -> None:
    Runner(ROOT).run_page(parse(page, "made.md"))


def test_a_failing_block_fails() -> None:
    page = "# x\n\n<!-- test: run -->\n```bash\necho before\nfalse\necho after\n```\n"
    with pytest.raises(DocBlockError, match=r"made\.md:4: the bash block failed \(exit 1\)"
                       r"(?s:.*)--- output ---\nbefore\n$"):
        _run(page)


def test_a_failing_python_block_fails() -> None:
    page = "<!-- test: run -->\n```python\nassert 1 + 1 == 3, 'arithmetic'\n```\n"
    with pytest.raises(DocBlockError, match=r"(?s)exit 1.*AssertionError: arithmetic"):
        _run(page)


def test_a_block_past_its_timeout_fails() -> None:
    page = "<!-- test: run timeout=2 -->\n```bash\nsleep 600\n```\n"  # a hang, on purpose
    with pytest.raises(DocBlockError, match="ran past 2 s"):
        _run(page)


def test_a_server_that_does_not_start_fails() -> None:
    page = "<!-- test: server -->\n```bash\ndpserve serve --no-such-flag\n```\n"
    with pytest.raises(DocBlockError, match="(?s)server exited early.*--no-such-flag"):
        _run(page)


def test_make_serve_is_its_recipe(runner: Runner) -> None:
    argv = server_argv("make serve\n", 4321, ROOT, runner.env)
    assert argv[0].endswith("dpserve") and argv[1] == "serve", argv
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "4321"], argv
    assert "8000" not in argv, argv


@pytest.mark.slow
@pytest.mark.parametrize("page", marked_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_blocks_run(runner: Runner, page: Path) -> None:
    runner.run_page(parse(page.read_text(), str(page.relative_to(ROOT))))
