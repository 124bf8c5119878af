"""How long does `dpserve serve` take to start, and how much CPU does it burn on the way?

Starts `dpserve serve` --runs times, polls GET /health every 20 ms and records, per
run, the wall seconds from launching the process to the first 200 and the CPU
seconds (user + system) every process of the server used until then: the live
ones read at that moment, the ones already gone (e.g. short-lived helpers) from
the launcher's reaped-children totals. Per process name (launcher, engines,
coordinator, ...) too. CPU time is the stable figure on a shared machine.

    .venv/bin/python bench/startup.py                      # the default model, DP=1
    .venv/bin/python bench/startup.py --dp 2
    .venv/bin/python bench/startup.py --tiny --dp 2 --eager  # as the tests start servers
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _timeline(log: str, started: float) -> str:
    """The server's log lines, each prefixed by its seconds since the launch."""
    lines = []
    for line in log.splitlines():
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
        if m:
            at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            line = f"{at + int(m.group(2)) / 1000 - started:7.2f}  {line[m.end():]}"
        lines.append(line)
    return "\n".join(lines)


def one_start(model: list[str], extra: list[str], env: dict[str, str], timeout: float,
              show_log: bool = False) -> tuple[float, float, dict[str, float]]:
    """(wall s to /health 200, CPU s of the whole tree, CPU s per process name)."""
    port = _free_port()
    with tempfile.NamedTemporaryFile("w+", prefix="dpserve-startup-", suffix=".log") as log:
        started = time.time()
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "dpserve.cli", "serve", *model,
                                 "--port", str(port), *extra], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            root = psutil.Process(proc.pid)
            url = f"http://127.0.0.1:{port}/health"
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"server exited early:\n{log.read()[-3000:]}")
                if time.monotonic() - start > timeout:
                    raise RuntimeError("server not healthy in time")
                try:
                    if httpx.get(url, timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
            wall = time.monotonic() - start
            if show_log:
                log.seek(0)
                print(_timeline(log.read(), started))
                print(f"{wall:7.2f}  GET /health: 200")
            per_name: dict[str, float] = collections.defaultdict(float)
            with root.oneshot():
                t = root.cpu_times()
                per_name["launcher"] += t.user + t.system
                reaped = t.children_user + t.children_system
            per_name["(exited children)"] += reaped
            for child in root.children(recursive=True):
                try:
                    per_name[child.name().removeprefix("dpserve::")] += _cpu(child)
                except psutil.NoSuchProcess:
                    pass
            return wall, sum(per_name.values()), dict(per_name)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dp", type=int, default=1, help="--data-parallel-size")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random llama (dpserve.testing.tiny_model) "
                             "instead of the default model")
    parser.add_argument("--eager", action="store_true", help="DPSERVE_ENFORCE_EAGER=1")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--show-log", action="store_true",
                        help="print the log of each run, with seconds since the launch")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an extra argument for dpserve serve (repeatable)")
    args = parser.parse_args()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.eager:
        env["DPSERVE_ENFORCE_EAGER"] = "1"
    tmp = tempfile.TemporaryDirectory(prefix="dpserve-startup-model-")
    model: list[str] = []
    if args.tiny:
        from dpserve.testing.tiny_model import make_tiny_model

        model = [str(make_tiny_model(tmp.name, "llama"))]
    extra = ["--data-parallel-size", str(args.dp), *args.serve_arg]
    walls, cpus = [], []
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for i in range(args.runs):
        wall, cpu, names = one_start(model, extra, env, args.timeout, args.show_log)
        walls.append(wall)
        cpus.append(cpu)
        for name, value in names.items():
            per_name[name].append(value)
        print(f"run {i + 1}: wall {wall:.2f} s, CPU {cpu:.2f} s  "
              + ", ".join(f"{n} {v:.2f}" for n, v in sorted(names.items())), flush=True)
    print(f"{'tiny' if args.tiny else 'default'} model, DP={args.dp}"
          f"{', eager' if args.eager else ''}: wall median {statistics.median(walls):.2f} s "
          f"(min {min(walls):.2f}), CPU median {statistics.median(cpus):.2f} s "
          f"(min {min(cpus):.2f})")
    for name, values in sorted(per_name.items()):
        print(f"  {name:24s} CPU median {statistics.median(values):.2f} s")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
