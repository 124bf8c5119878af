"""Serving load generator: `dpserve bench serve`.

Sends `num_prompts` streaming requests to an OpenAI-compatible server (dpserve,
vLLM, ...) with exactly `concurrency` of them in flight until the work runs out,
and measures per request the time to the first content chunk (TTFT), the gaps
between content chunks (ITL), the end-to-end latency and the output tokens from
the final usage chunk. Every request asks for exactly `output_len` tokens
(`max_tokens` + `ignore_eos`, temperature 0). Completions prompts are lists of
seeded random token ids in [100, vocab_size), so prompt lengths are exact; chat
prompts are random common words (about one token each). `prompt_mix` mixes
prompt lengths in fixed proportions (e.g. `16:4,1024:1`: four 16-token prompts
per 1024-token one) in a seeded random order, the same for every run with the
same seed.

Bounded: each request has a `timeout`, the whole run (model discovery, warm-up
and measurement) a `max_duration`; requests cut off by it count as failed and
those never started as not sent.

Not here: request-rate (Poisson) arrivals, datasets, goodput, starting a server.

    dpserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --concurrency 16 --json-out result.json --append-md BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

import httpx
import numpy as np

_ENDPOINTS = ("completions", "chat")
_WORDS = ("the of and to in is for on that with as at by from this be are was it an or time "
          "data model server token request batch cache engine queue memory block prompt output "
          "river city market garden music light water paper table green small early").split()


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class BenchConfig:
    """What to benchmark and how; validated on construction, never changed afterwards."""

    base_url: str = _opt("http://127.0.0.1:8000", "Server root (a trailing /v1 is accepted).")
    endpoint: str = _opt("completions", "API to call.", choices=_ENDPOINTS)
    model: str | None = _opt(None, "Model name to send (default: first entry of GET /v1/models).")
    api_key: str | None = _opt(None, "Bearer token, if the server wants one.")
    num_prompts: int = _opt(64, "Measured requests.")
    concurrency: int = _opt(16, "Requests kept in flight at once.")
    prompt_len: int = _opt(128, "Prompt tokens per request (chat: words, about one token each).")
    prompt_mix: str | None = _opt(None, "Mixed prompt lengths instead of prompt_len, as "
                                  "LEN:WEIGHT,... (e.g. 16:4,1024:1 = four 16-token prompts "
                                  "per 1024-token one, in a seeded random order).")
    output_len: int = _opt(64, "Output tokens per request (max_tokens, with ignore_eos).")
    vocab_size: int = _opt(49152, "Prompt token ids are drawn from [100, vocab_size).")
    seed: int = _opt(0, "Seed of the random prompts.")
    warmup: int = _opt(2, "Warm-up requests sent first and not counted.")
    timeout: float = _opt(300.0, "Seconds one request may take before it counts as failed.")
    max_duration: float = _opt(1800.0, "Seconds the whole run may take; then it stops.")
    extra_body: str | None = _opt(None, "A JSON object merged into every request body "
                                  "(e.g. a response_format).")

    def __post_init__(self) -> None:
        if self.endpoint not in _ENDPOINTS:
            raise ValueError(f"endpoint must be one of {_ENDPOINTS}, got {self.endpoint!r}")
        lows = {"num_prompts": 1, "concurrency": 1, "prompt_len": 1, "output_len": 1,
                "vocab_size": 101, "warmup": 0}
        for name, low in lows.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")
        if min(self.timeout, self.max_duration) <= 0:
            raise ValueError("timeout and max_duration must be positive")
        if self.prompt_mix is not None:
            parse_prompt_mix(self.prompt_mix)
        if self.extra_body is not None and not isinstance(json.loads(self.extra_body), dict):
            raise ValueError("extra_body must be a JSON object")

    @property
    def prompt_desc(self) -> str:
        """The prompt length for reports: '128' or 'mixed 16:4,1024:1'."""
        return f"mixed {self.prompt_mix}" if self.prompt_mix else str(self.prompt_len)

    @property
    def root(self) -> str:
        """base_url without a trailing slash or /v1."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def url(self) -> str:
        path = "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"
        return self.root + path


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from just before sending."""

    prompt_tokens: int  # from usage; else the prompt's length (chat: words)
    ok: bool = False
    output_tokens: int = 0  # from the final usage chunk; else the number of content chunks
    ttft_s: float | None = None  # None when no content chunk arrived
    itl_s: list[float] = field(default_factory=list)  # [content chunks - 1] gaps between them
    e2e_s: float = 0.0
    error: str = ""


@dataclass
class Latency:
    """Summary of a latency sample, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Latency | None:
        if not seconds:
            return None
        ms = np.asarray(seconds) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass
class BenchResult:
    """The measured phase; throughputs count completed requests only."""

    config: BenchConfig
    model: str  # the model actually sent (config.model or discovered)
    duration_s: float
    completed: int
    failed: int
    not_sent: int  # never started because max_duration ran out
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output tokens) / s
    ttft_ms: Latency | None
    itl_ms: Latency | None  # pooled over all gaps of all completed requests
    e2e_ms: Latency | None
    requests: list[RequestResult]  # measured requests in prompt order (not_sent left out)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["config"]["api_key"]:
            out["config"]["api_key"] = "***"
        return out


def parse_prompt_mix(text: str) -> list[tuple[int, int]]:
    """'16:4,1024:1' -> [(16, 4), (1024, 1)]: (prompt length, weight) pairs; ValueError."""
    try:
        mix = [(int(n), int(w)) for n, w in (part.split(":") for part in text.split(","))]
    except ValueError:  # a part that is not two integers
        mix = []
    if not mix or min(min(m) for m in mix) < 1:
        raise ValueError(f"prompt_mix must be LEN:WEIGHT,... with positive integers "
                         f"(e.g. 16:4,1024:1), got {text!r}")
    return mix


def prompt_lengths(config: BenchConfig, num: int, rng: random.Random) -> list[int]:
    """`num` prompt lengths: prompt_len, or prompt_mix's lengths in its proportions.

    With a mix, the pattern (each length repeated by its weight) is cycled to `num`
    entries, so the proportions are exact when `num` is a multiple of the summed
    weights, and then shuffled by `rng`.
    """
    if config.prompt_mix is None:
        return [config.prompt_len] * num
    pattern = [n for n, w in parse_prompt_mix(config.prompt_mix) for _ in range(w)]
    lengths = [pattern[i % len(pattern)] for i in range(num)]
    rng.shuffle(lengths)
    return lengths


def make_prompts(config: BenchConfig, num: int, seed: int) -> list[list[int]] | list[str]:
    """Seeded prompts: token-id lists for completions, random words for chat."""
    rng = random.Random(seed)
    lengths = prompt_lengths(config, num, rng)
    if config.endpoint == "completions":
        return [[rng.randrange(100, config.vocab_size) for _ in range(n)] for n in lengths]
    return [" ".join(rng.choice(_WORDS) for _ in range(n)) for n in lengths]


def _body(config: BenchConfig, model: str, prompt: list[int] | str) -> dict[str, Any]:
    inputs = ({"prompt": prompt} if config.endpoint == "completions"
              else {"messages": [{"role": "user", "content": prompt}]})
    return {"model": model, **inputs, "max_tokens": config.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **(json.loads(config.extra_body) if config.extra_body else {})}


def _chunk_text(data: dict[str, Any]) -> str:
    """The content of a stream chunk ('' for role-only, usage-only or empty chunks)."""
    c = (data.get("choices") or [{}])[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def _stream_one(client: httpx.AsyncClient, config: BenchConfig,
                      body: dict[str, Any], rec: RequestResult, start: float) -> None:
    """Send one request and fill `rec` as chunks arrive (partial on timeout/cancel)."""
    async with client.stream("POST", config.url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            rec.error = f"HTTP {resp.status_code}: {text[:300]}"
            return
        last, chunks, usage_seen = start, 0, False
        # Read to the end of the stream (not just to [DONE]) so the connection is reusable.
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments, event names
            payload = line[5:].strip()
            if payload == "[DONE]":
                continue
            data = json.loads(payload)
            if "error" in data:
                rec.error = f"stream error: {json.dumps(data['error'])[:300]}"
                return
            if usage := data.get("usage"):
                usage_seen = True
                rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
                rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
            if _chunk_text(data):
                now = time.perf_counter()
                if chunks == 0:
                    rec.ttft_s = now - start
                else:
                    rec.itl_s.append(now - last)
                last, chunks = now, chunks + 1
                if not usage_seen:
                    rec.output_tokens = chunks
    if chunks == 0 and rec.output_tokens == 0:
        rec.error = "stream ended without any content"
    else:
        rec.ok = True


async def _send(client: httpx.AsyncClient, config: BenchConfig, model: str,
                prompt: list[int] | str, rec: RequestResult) -> None:
    """One request into `rec`, bounded by config.timeout; raises only on cancellation."""
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream_one(client, config, _body(config, model, prompt),
                                           rec, start), config.timeout)
    except asyncio.TimeoutError:
        rec.ok, rec.error = False, f"timeout: no complete response after {config.timeout:g} s"
    except asyncio.CancelledError:
        rec.ok, rec.error = False, "stopped: --max-duration reached"
        raise
    except Exception as e:  # any transport or parse error fails this request only
        rec.ok, rec.error = False, f"{type(e).__name__}: {e}"
    finally:
        rec.e2e_s = time.perf_counter() - start


async def _run_phase(client: httpx.AsyncClient, config: BenchConfig, model: str,
                     prompts: list, deadline: float) -> list[RequestResult | None]:
    """Run `prompts` with `concurrency` workers until done or the deadline.

    Invariant: at most `concurrency` requests are in flight, since each worker awaits
    its request before taking the next index; entries left None were never sent.
    A worker also checks the deadline before each request: Python 3.11's wait_for can
    swallow a cancellation that lands as its request completes, and such a worker
    would otherwise go on through every remaining prompt.
    """
    results: list[RequestResult | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))  # shared: each index is taken by exactly one worker

    async def worker() -> None:
        for i in todo:
            if time.monotonic() >= deadline:
                return  # index i stays None: not sent
            p = prompts[i]
            results[i] = rec = RequestResult(len(p) if isinstance(p, list) else len(p.split()))
            await _send(client, config, model, p, rec)

    workers = [asyncio.create_task(worker()) for _ in range(min(config.concurrency,
                                                                len(prompts)))]
    _, pending = await asyncio.wait(workers, timeout=max(0.0, deadline - time.monotonic()))
    for w in pending:
        w.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return results


async def discover_model(client: httpx.AsyncClient, config: BenchConfig) -> str:
    resp = await client.get(config.root + "/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{config.root}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def run_benchmark(config: BenchConfig, prompts: list | None = None) -> BenchResult:
    """Warm up, then run the measured requests; returns when done or at max_duration.
    `prompts`: the measured prompts, in order (token-id lists for completions, text
    for chat), instead of config's random ones (e.g. bench/prefix_routing.py)."""
    deadline = time.monotonic() + config.max_duration
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + 4,
                          max_keepalive_connections=config.concurrency + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits,
                                 timeout=httpx.Timeout(config.timeout)) as client:
        model = config.model or await asyncio.wait_for(discover_model(client, config),
                                                       min(config.timeout, config.max_duration))
        if config.warmup:
            await _run_phase(client, config, model,
                             make_prompts(config, config.warmup, config.seed + 1), deadline)
        if prompts is None:
            prompts = make_prompts(config, config.num_prompts, config.seed)
        start = time.perf_counter()
        results = await _run_phase(client, config, model, prompts, deadline)
        duration = time.perf_counter() - start
    return summarise(config, model, results, duration)


def summarise(config: BenchConfig, model: str, results: list[RequestResult | None],
              duration: float) -> BenchResult:
    sent = [r for r in results if r is not None]
    ok = [r for r in sent if r.ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    return BenchResult(
        config=config, model=model, duration_s=duration, completed=len(ok),
        failed=len(sent) - len(ok), not_sent=len(results) - len(sent),
        total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=len(ok) * per_s, output_throughput=n_out * per_s,
        total_token_throughput=(n_in + n_out) * per_s,
        ttft_ms=Latency.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_ms=Latency.of([g for r in ok for g in r.itl_s]),
        e2e_ms=Latency.of([r.e2e_s for r in ok]), requests=sent)


def _fmt(lat: Latency | None, keys: tuple[str, ...] = ("mean", "p50", "p90", "p99")) -> str:
    if lat is None:
        return "n/a"
    return "  ".join(f"{k} {getattr(lat, k):.2f}" for k in keys)


def format_report(res: BenchResult) -> str:
    c = res.config
    lines = [
        "=============== dpserve bench serve ===============",
        f"Target:                     {res.model} at {c.url}",
        f"Workload:                   {c.num_prompts} requests, concurrency {c.concurrency}, "
        f"{c.prompt_desc} -> {c.output_len} tokens",
        f"Completed / failed / unsent: {res.completed} / {res.failed} / {res.not_sent}",
        f"Duration (s):               {res.duration_s:.2f}",
        f"Request throughput (req/s): {res.request_throughput:.2f}",
        f"Output throughput (tok/s):  {res.output_throughput:.2f}",
        f"Total throughput (tok/s):   {res.total_token_throughput:.2f}",
        f"Tokens in / out:            {res.total_input_tokens} / {res.total_output_tokens}",
        f"TTFT (ms):                  {_fmt(res.ttft_ms)}",
        f"ITL (ms):                   {_fmt(res.itl_ms)}",
        f"E2E latency (ms):           {_fmt(res.e2e_ms, ('p50', 'p99'))}",
    ]
    errors = Counter(r.error for r in res.requests if not r.ok)
    for text, n in errors.most_common(3):
        lines.append(f"Error x{n}: {text}")
    return "\n".join(lines + ["=" * 51])


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, with an --api-key value masked."""
    argv = list(sys.argv if argv is None else argv)
    prog = os.path.basename(argv[0]) if argv else "dpserve"
    modules = {"serve.py": "dpserve.benchmark.serve", "cli.py": "dpserve.cli"}
    words = ["python", "-m", modules[prog]] if prog in modules else [prog]
    for i, a in enumerate(argv[1:], start=1):
        masked = argv[i - 1] == "--api-key"
        words.append("***" if masked else "--api-key=***" if a.startswith("--api-key=") else a)
    return shlex.join(words)


def format_markdown(res: BenchResult, command: str) -> str:
    c = res.config
    return "\n".join([
        f"\n## bench serve, {datetime.date.today().isoformat()}\n",
        f"- machine: {machine()}",
        f"- command: `{command}`",
        f"- target: {res.model} at {c.url}",
        f"- workload: {c.num_prompts} requests, concurrency {c.concurrency}, {c.prompt_desc} "
        f"prompt -> {c.output_len} output tokens, ignore_eos, temperature 0, "
        f"{c.warmup} warm-up",
        f"- completed {res.completed}, failed {res.failed}, not sent {res.not_sent} "
        f"in {res.duration_s:.2f} s",
        f"- throughput: **{res.output_throughput:.1f} output tok/s**, "
        f"{res.request_throughput:.2f} req/s, {res.total_token_throughput:.1f} total tok/s",
        f"- TTFT ms: {_fmt(res.ttft_ms)}",
        f"- ITL ms: {_fmt(res.itl_ms)}",
        f"- E2E ms: {_fmt(res.e2e_ms, ('p50', 'p99'))}",
    ]) + "\n"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per BenchConfig field (its doc is the --help), plus the output files."""
    kinds = {"int": int, "float": float}
    for f in fields(BenchConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default,
                            type=kinds.get(str(f.type), str), help=f.metadata["help"],
                            choices=f.metadata.get("choices"))
    parser.add_argument("--json-out", metavar="FILE", help="Write the result as JSON here.")
    parser.add_argument("--append-md", metavar="FILE",
                        help="Append a markdown section (date, machine, command, figures).")


def main(args: argparse.Namespace) -> int:
    """Run from parsed flags. Exit status: 0 every measured request completed, 1 some
    failed, were not sent or the server could not be asked, 2 a bad option."""
    try:
        config = BenchConfig(**{f.name: getattr(args, f.name) for f in fields(BenchConfig)})
    except ValueError as e:
        print(f"dpserve bench serve: error: {e}", file=sys.stderr)
        return 2
    try:
        res = asyncio.run(run_benchmark(config))
    except (httpx.HTTPError, RuntimeError, OSError, asyncio.TimeoutError) as e:
        print(f"dpserve bench serve: error: {config.root}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    print(format_report(res))
    if args.json_out:
        doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": machine(), "command": command_line(), **res.to_json()}
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=2)
    if args.append_md:
        with open(args.append_md, "a") as f:
            f.write(format_markdown(res, command_line()))
    return 0 if res.failed == 0 and res.not_sent == 0 else 1


if __name__ == "__main__":
    class _Formatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
        pass

    _parser = argparse.ArgumentParser(prog="python -m dpserve.benchmark.serve",
                                      description=__doc__, formatter_class=_Formatter)
    add_cli_args(_parser)
    sys.exit(main(_parser.parse_args()))
