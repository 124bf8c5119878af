"""The `dpserve` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from dpserve.config import ConfigError, EngineArgs
from dpserve.logging_utils import hide_command_line, setup_logging

MIN_PYTHON = (3, 10, 9)  # pyproject.toml's requires-python: CVE-2022-42919's forkserver


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="Generate text offline with one engine.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face directory, .gguf file or hub name "
                        "(default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", required=True,
                   help="Prompt text; repeat for several prompts.")
    p.add_argument("--chat", action="store_true",
                   help="Treat each prompt as a user message and apply the chat template.")
    p.add_argument("--max-tokens", type=int, default=128, help="Tokens to generate at most.")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    p.add_argument("--top-k", type=int, default=-1, help="Top-k sampling (-1 = off).")
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="Per-request sampling seed (reproducible sampling).")
    p.add_argument("--stop", action="append", default=[], help="Stop string (repeatable).")
    p.add_argument("--json", action="store_true", help="Print results as JSON lines.")
    EngineArgs.add_cli_args(p.add_argument_group("engine options"))
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from dpserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                            stop=args.stop)
    llm = LLM(**vars(EngineArgs.from_cli(args)))
    if args.chat:
        convs = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(convs, params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outputs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        else:
            print(c.text)
    return 0


# The subcommands whose options and run live in an entrypoint module: (name, help,
# module, its `add_*_args`, its `run_*`). The module is imported when the parser is
# built, as before, so `dpserve --help` names every subcommand.
_ENTRYPOINTS = (
    ("serve", "Serve a model over an OpenAI-compatible HTTP API.", "serve", "add_serve_args",
     "run_serve"),
    ("run-batch", "Run an OpenAI batch file (JSONL) offline.", "run_batch",
     "add_run_batch_args", "run_batch"),
    ("scale", "Change a running server's number of DP engines.", "scale", "add_scale_args",
     "run_scale"),
    ("top", "Watch a running server's ranks, queues, tokens/s and tenants in the terminal.",
     "top", "add_top_args", "run_top"),
    ("save-sharded-state", "Save each tensor-parallel worker's weights for --load-format "
     "sharded_state.", "save_sharded_state", "add_save_args", "run_save"),
)


def _entrypoint_parser(sub: argparse._SubParsersAction, name: str, help: str,
                       module: str, add_args: str, run: str) -> None:
    entry = importlib.import_module(f"dpserve.entrypoints.{module}")
    p = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    getattr(entry, add_args)(p)
    p.set_defaults(func=getattr(entry, run))


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from dpserve.benchmark import serve as bench_serve

    p = sub.add_parser("bench", help="Benchmarks.")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    bp = bench_sub.add_parser("serve", help="Load-test an OpenAI-compatible server.",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bench_serve.add_cli_args(bp)
    bp.set_defaults(func=bench_serve.main)


def main(argv: list[str] | None = None) -> int:
    from dpserve.version import __version__

    if sys.version_info < MIN_PYTHON:
        print(f"dpserve: error: Python {'.'.join(map(str, MIN_PYTHON))} or newer is needed "
              f"(this is {sys.version.split()[0]}): older forkservers run code from any "
              "local user (CVE-2022-42919)", file=sys.stderr)
        return 2
    if argv is None:  # our own command line: secrets in it leave `ps` now
        argv = sys.argv[1:]
        hide_command_line()  # (scrubs sys.argv: parse the copy)
    parser = argparse.ArgumentParser(prog="dpserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dpserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    for entrypoint in _ENTRYPOINTS:
        _entrypoint_parser(sub, *entrypoint)
    _bench_parser(sub)
    args = parser.parse_args(argv)
    setup_logging()
    try:
        return args.func(args)
    except (ConfigError, ValueError) as e:
        print(f"dpserve: error: {_as_flag(str(e))}", file=sys.stderr)
        return 2


def _as_flag(message: str) -> str:
    """Name the command-line flag, not the Python keyword, in an option error."""
    import dataclasses

    for f in dataclasses.fields(EngineArgs):
        if message.startswith(f.name + " ") or message.startswith(f.name + ":"):
            return "--" + f.name.replace("_", "-") + message[len(f.name):]
    return message


def entry() -> None:
    """The `dpserve` command."""
    code = main()
    teardown = sys.modules.get("dpserve.launch.ray_teardown")
    if teardown is not None and teardown.connection_abandoned():
        # Ray's core worker still holds a connection to a dead instance: the
        # interpreter's teardown could crash in it. Everything dpserve owns is closed.
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
