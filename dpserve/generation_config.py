"""The model's generation_config.json as default sampling parameters.

`--generation-config auto` (the default, as in vLLM) reads the model directory's
generation_config.json; a directory path reads that directory's; `vllm` reads
nothing. The keys vLLM takes from it (temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as max_tokens) become the defaults of
requests that do not set them: the server's completions and chat, and the
offline `LLM` when it is given no SamplingParams. Resolved once into
`ModelConfig.generation_defaults`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dpserve.errors import ConfigError

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(mode: str, model_path: str) -> tuple[tuple[str, Any], ...]:
    """`auto` | `vllm` | a directory -> ((SamplingParams field, value), ...)."""
    if mode == "vllm":
        return ()
    directory = Path(model_path if mode == "auto" else mode)
    if mode != "auto" and not directory.is_dir():
        raise ConfigError(f"generation_config must be 'auto', 'vllm' or a directory holding "
                          f"generation_config.json, got {mode!r}")
    path = directory / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"generation_config: cannot read {path}: {e}") from None
    defaults = tuple((field, data[key]) for key, field in _KEYS.items()
                     if data.get(key) is not None)
    if defaults:
        from dpserve.sampling_params import SamplingParams

        try:
            SamplingParams(**dict(defaults))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"generation_config: {path} holds a bad default: {e}") from None
    return defaults


def log_generation_defaults(defaults: tuple[tuple[str, Any], ...]) -> None:
    """One start-up line saying which defaults requests get (if any)."""
    if defaults:
        logger.info("default sampling parameters from the model's generation_config.json "
                    "(for requests that do not set them; --generation-config vllm to "
                    "ignore): %s", ", ".join(f"{k}={v}" for k, v in defaults))
