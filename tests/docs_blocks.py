"""Run the code blocks that the docs mark for it (README.md, docs/**/*.md).

A block runs only when an HTML comment on the line before its fence says so
(blank lines may stand between; the comment shows nowhere on the site or on
GitHub):

    <!-- test: run -->              run the block; it must exit 0
    <!-- test: run timeout=300 -->  the same, with more than the default 120 s
    <!-- test: server -->           the block starts a server: the test starts it
                                    (on 127.0.0.1, a free port) and keeps it for the
                                    page's later blocks
    <!-- test: skip -->             not run (says so on purpose; the same as no
                                    comment)

A `run` block is ```bash (also sh, shell: run with `bash -euo pipefail`) or
```python (py: run with the test's interpreter). A `server` block is bash and holds
one `dpserve serve ...` or `make serve` line (others are ignored); `make serve`
means the command its recipe runs (`make -n serve`).

The address: a block writes the server as 127.0.0.1:8000 or localhost:8000
(0.0.0.0:8000 too); the test replaces it with the address of the server it
started. A server block's `--host` and `--port` are replaced (added when
missing). A `run` block that names port 8000 with no server block above it on
its page gets the default server, `make serve`'s, started once for every page
(the quick start's "with `make serve` running").

Every block runs from the repository root, with the test's virtualenv first on
PATH and the tree on PYTHONPATH, so `dpserve`, `python` and `import dpserve` are
this checkout's. A marker followed by anything but a code block, an unknown
action or option, or a language that cannot run is an error (`DocBlockError`),
as is a block that fails or outlives its timeout.

Not here: which pages are read and the tests (tests/unit/test_docs_blocks.py,
tests/server/test_docs_examples.py).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from helpers import free_port, stop_all, wait_healthy

ACTIONS = ("run", "server", "skip")
LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python",
             "py": "python"}
RUN_TIMEOUT_S = 120.0
SERVER_TIMEOUT_S = 300.0  # until /health answers 200 (the model loaded)
DOCS_PORT = 8000  # the port the docs write
_MARKER = re.compile(r"^\s*<!--\s*test:\s*(\w+)((?:\s+\w+=\S+)*)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
_ADDRESS = re.compile(rf"\b(?:localhost|127\.0\.0\.1|0\.0\.0\.0):{DOCS_PORT}\b")


class DocBlockError(AssertionError):
    """A marked block is malformed, or it failed."""


@dataclass(frozen=True)
class Block:
    """One marked code block."""

    page: str  # its page, for messages (relative to the repository root)
    line: int  # the line of its opening fence, 1-based
    action: str  # one of ACTIONS
    lang: str  # "bash" | "python" (LANGUAGES' values)
    code: str  # its text, dedented to its fence
    timeout: float  # seconds (a server block: until it is healthy)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(text: str, page: str) -> list[Block]:
    """The marked blocks of a page, in order (`skip` ones too)."""
    lines, blocks, pending = text.splitlines(), [], None
    i = 0
    while i < len(lines):
        marker, fence = _MARKER.match(lines[i]), _FENCE.match(lines[i])
        if marker:
            if pending is not None:
                raise DocBlockError(f"{page}:{pending[0]}: a test marker with no code block")
            pending = (i + 1, marker.group(1), marker.group(2))
        elif fence:
            end = _fence_end(lines, i, fence)
            if pending is not None:
                blocks.append(_block(page, pending, i + 1, fence, lines[i + 1:end]))
                pending = None
            i = end
        elif lines[i].strip() and pending is not None:
            raise DocBlockError(f"{page}:{pending[0]}: a test marker must stand right "
                                f"before a code block, not before {lines[i].strip()!r}")
        i += 1
    if pending is not None:
        raise DocBlockError(f"{page}:{pending[0]}: a test marker with no code block")
    return blocks


def _fence_end(lines: list[str], start: int, fence: re.Match) -> int:
    """The index of the line that closes the fence opened at `start`."""
    closing = re.compile(rf"^\s*{re.escape(fence.group(2)[0])}{{{len(fence.group(2))},}}\s*$")
    for j in range(start + 1, len(lines)):
        if closing.match(lines[j]):
            return j
    return len(lines)  # unclosed: CommonMark runs it to the end of the page


def _block(page: str, marker: tuple[int, str, str], line: int, fence: re.Match,
           body: list[str]) -> Block:
    marker_line, action, option_text = marker
    where = f"{page}:{marker_line}"
    if action not in ACTIONS:
        raise DocBlockError(f"{where}: unknown test action {action!r} (one of {ACTIONS})")
    options = dict(option.split("=", 1) for option in option_text.split())
    unknown = set(options) - {"timeout"}
    if unknown:
        raise DocBlockError(f"{where}: unknown test option(s) {sorted(unknown)} (timeout=S)")
    info = fence.group(3).strip().lstrip("{.").split()
    lang = LANGUAGES.get(info[0].lower() if info else "")
    if action != "skip" and (lang is None or action == "server" and lang != "bash"):
        kinds = "bash" if action == "server" else ", ".join(LANGUAGES)
        raise DocBlockError(f"{where}: a {action!r} block must be one of: {kinds} "
                            f"(the fence says {fence.group(3).strip()!r})")
    indent = len(fence.group(1))  # a fence inside a list or tab: its text is indented
    code = "\n".join(text[min(indent, len(text) - len(text.lstrip())):] for text in body)
    default = SERVER_TIMEOUT_S if action == "server" else RUN_TIMEOUT_S
    return Block(page, line, action, lang or "", code + "\n",
                 float(options.get("timeout", default)))


def needs_server(code: str) -> bool:
    """Whether a block talks to the docs' server address."""
    return bool(_ADDRESS.search(code))


def client_code(code: str, port: int) -> str:
    """A block's text with the docs' server address replaced by 127.0.0.1:`port`."""
    return _ADDRESS.sub(f"127.0.0.1:{port}", code)


def server_argv(code: str, port: int, root: Path, env: dict[str, str]) -> list[str]:
    """The server command of a server block, on 127.0.0.1:`port`."""
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["make", "serve"]:
            words = _make_serve(root, env)
        if _is_serve(words):
            return _listen_on(words, port)
    raise DocBlockError(f"no `dpserve serve` or `make serve` line in:\n{code}")


def _make_serve(root: Path, env: dict[str, str]) -> list[str]:
    """The `dpserve serve` command `make serve` runs (its recipe, not run)."""
    printed = subprocess.run(["make", "-n", "--no-print-directory", "serve"], cwd=root,
                             env=env, capture_output=True, text=True, timeout=60)
    for line in printed.stdout.splitlines():  # (set-up lines first, when it is due)
        if "dpserve" in line and _is_serve(words := shlex.split(line)):
            return words
    raise DocBlockError(f"`make -n serve` runs no `dpserve serve`:\n{printed.stdout}"
                        f"{printed.stderr}")


def _is_serve(words: list[str]) -> bool:
    """`dpserve serve ...`, `.venv/bin/dpserve serve ...`, `python -m dpserve serve ...`."""
    return any(word.endswith(("dpserve", "dpserve.cli")) and words[k + 1:k + 2] == ["serve"]
               for k, word in enumerate(words[:3]))


def _listen_on(words: list[str], port: int) -> list[str]:
    """`words` with --host 127.0.0.1 and --port `port` (replaced, or added)."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("--host", "--port"):
            skip = True
        elif not word.startswith(("--host=", "--port=")):
            out.append(word)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


class Runner:
    """Runs pages' marked blocks in order; owns the servers they need."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        """`env`: more variables for the blocks and servers."""
        self.root = root
        venv_bin = str(Path(sys.executable).parent)
        self.env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
        self.env.update(env or {})
        self.env["PATH"] = venv_bin + os.pathsep + self.env.get("PATH", "")
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(root), self.env.get("PYTHONPATH", "")) if p)
        self.default: tuple[subprocess.Popen, int] | None = None  # `make serve`'s, shared

    def run_page(self, blocks: list[Block]) -> None:
        """Run `blocks` (one page's) in order; a server block's server lives until the
        page ends. Raises DocBlockError for the first block that fails."""
        server: tuple[subprocess.Popen, int] | None = None
        try:
            for block in blocks:
                if block.action == "server":
                    if server is not None:
                        _stop(server)
                    server = self.start(block.code, block.timeout, block.where)
                elif block.action == "run":
                    port = self._port_for(block, server)
                    self.run(block, client_code(block.code, port) if port else block.code)
        finally:
            if server is not None:
                _stop(server)

    def _port_for(self, block: Block, server: tuple[subprocess.Popen, int] | None
                  ) -> int | None:
        if not needs_server(block.code):
            return None
        if server is None:
            if self.default is None:
                self.default = self.start("make serve", SERVER_TIMEOUT_S, "make serve")
            server = self.default
        if server[0].poll() is not None:
            raise DocBlockError(f"{block.where}: the server exited before this block:\n"
                                f"{_tail(server[0].log)}")  # type: ignore[attr-defined]
        return server[1]

    def start(self, code: str, timeout: float, where: str) -> tuple[subprocess.Popen, int]:
        """Start a server block's server and wait until it is healthy."""
        port = free_port()
        argv = server_argv(code, port, self.root, self.env)
        log = tempfile.NamedTemporaryFile("w+", prefix="docs-server-", suffix=".log")
        proc = subprocess.Popen(argv, cwd=self.root, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        proc.log = log  # type: ignore[attr-defined]
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", timeout,
                         describe=lambda: f"{where}: {shlex.join(argv)}\n{_tail(log)}")
        except AssertionError as e:
            _stop((proc, port))
            raise DocBlockError(str(e)) from None
        return proc, port

    def run(self, block: Block, code: str) -> None:
        """Run one block's `code`; DocBlockError when it fails or runs too long."""
        with tempfile.NamedTemporaryFile("w", suffix=".py" if block.lang == "python"
                                         else ".sh") as script:
            script.write(code)
            script.flush()
            argv = ([sys.executable, script.name] if block.lang == "python"
                    else ["bash", "-euo", "pipefail", script.name])
            proc = subprocess.Popen(argv, cwd=self.root, env=self.env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=block.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                raise DocBlockError(f"{block.where}: the {block.lang} block ran past "
                                    f"{block.timeout:g} s:\n{code}--- output ---\n"
                                    f"{out[-3000:]}") from None
        if proc.returncode != 0:
            raise DocBlockError(f"{block.where}: the {block.lang} block failed (exit "
                                f"{proc.returncode}):\n{code}--- output ---\n{out[-3000:]}")

    def close(self) -> None:
        if self.default is not None:
            _stop(self.default)
            self.default = None


def _stop(server: tuple[subprocess.Popen, int]) -> None:
    """SIGTERM (the server drains: 30 s at most), then harder (`stop_all`)."""
    stop_all([server[0]], 60)
    server[0].log.close()  # type: ignore[attr-defined]


def _tail(log) -> str:
    with open(log.name) as f:
        return f.read()[-3000:]
