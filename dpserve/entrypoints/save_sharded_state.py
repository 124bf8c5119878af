"""`dpserve save-sharded-state MODEL --output DIR -tp N`: save each tensor-parallel
worker's shard of the weights (vLLM's examples/offline_inference/save_sharded_state.py).

Loads MODEL with the engine options given (an offline `LLM`, kernels not compiled),
has every worker write its own files (`model-rank-{rank}-part-{part}.safetensors`,
parts of --max-file-size at most) and copies the config and tokenizer files: DIR then
serves as a model with `--load-format sharded_state` at the same
--tensor-parallel-size, each worker reading only its own files.

A command of its own, not an admin route: it writes a directory the operator names,
which an HTTP caller should not choose on the server's host.

Not here: the files (`dpserve.checkpoint.sharded_state`), the engine utility
(`save_sharded_state`, `dpserve.engine.utilities`).
"""

from __future__ import annotations

import argparse
import dataclasses

from dpserve.checkpoint.sharded_state import DEFAULT_MAX_SIZE, DEFAULT_PATTERN
from dpserve.config import EngineArgs, parse_memory_size


def add_save_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face directory, .gguf file or hub name "
                             "(default: built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--output", required=True,
                        help="Directory to write the shards and the model's other files to.")
    parser.add_argument("--file-pattern", default=DEFAULT_PATTERN,
                        help="File name of each worker's parts ({rank} and {part}).")
    parser.add_argument("--max-file-size", default=str(DEFAULT_MAX_SIZE),
                        help="Bytes per file at most (or with a unit: 2GiB).")
    EngineArgs.add_cli_args(parser.add_argument_group("engine options"))


def run_save(args: argparse.Namespace) -> int:
    from dpserve.entrypoints.llm import LLM

    max_size = parse_memory_size(args.max_file_size, "max_file_size")
    engine_args = dataclasses.replace(EngineArgs.from_cli(args), enforce_eager=True)
    llm = LLM(**vars(engine_args))
    try:
        files = llm.save_sharded_state(args.output, args.file_pattern, max_size)
    finally:
        llm.shutdown()
    print(f"saved {len(files)} shard file(s) to {args.output}: serve it with "
          f"--load-format sharded_state --tensor-parallel-size "
          f"{engine_args.tensor_parallel_size}")
    return 0
