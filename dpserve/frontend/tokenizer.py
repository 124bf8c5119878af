"""Loading a tokenizer and rendering chat prompts (front-end side only)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

_preloads: dict[str, Future] = {}
_preloads_lock = threading.Lock()


def _load(path: str) -> Any:
    if _plain_llama_backend(path):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _plain_llama_backend(path: str) -> bool:
    """Whether `path` is a local Llama directory whose tokenizer_config.json names
    TokenizersBackend, with no custom code: AutoTokenizer then loads exactly that
    class (transformers 5), but only after reading the model config through
    AutoConfig, which imports torch and modeling code (~3 s of CPU in every API
    server). dpserve's GGUF conversions (the default model) and the test models
    are such directories; tests/unit/test_tokenizer_load.py holds the two loads equal."""
    directory = Path(path)
    try:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(tokenizer_config, dict) and isinstance(config, dict)
            and tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
            and config.get("model_type") == "llama"
            and "auto_map" not in tokenizer_config and "auto_map" not in config)


def preload_tokenizer(path: str) -> None:
    """Start loading `path`'s tokenizer on a daemon thread (importing transformers
    alone takes seconds): a server calls this before it waits for its engines, so
    the wait and the load overlap; `load_tokenizer(path)` then takes the result."""
    future: Future = Future()
    with _preloads_lock:
        if path in _preloads:
            return
        _preloads[path] = future

    def run() -> None:
        try:
            future.set_result(_load(path))
        except BaseException as e:  # noqa: BLE001 - handed to load_tokenizer's caller
            future.set_exception(e)

    threading.Thread(target=run, name="tokenizer-preload", daemon=True).start()


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a local directory (or hub name); the preloaded
    one if `preload_tokenizer(path)` ran (each preload is used once)."""
    with _preloads_lock:
        future = _preloads.pop(path, None)
    if future is not None:
        return future.result()
    return _load(path)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True,
                        chat_template: str | None = None,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Render `messages` with the model's chat template and tokenise them."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass chat_template= or use "
                         "generate() with a plain prompt")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("each chat message must be a dict with 'role' and 'content'")
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template,
                                         **({"tools": tools} if tools else {}))
    # The template already holds any BOS token; do not add special tokens twice.
    return tokenizer.encode(text, add_special_tokens=False)


def eos_token_ids(tokenizer: Any, hf_config: dict[str, Any]) -> tuple[int | None, list[int]]:
    """(primary EOS id, extra ids that also end generation)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    cfg = hf_config.get("eos_token_id")
    for i in (cfg if isinstance(cfg, (list, tuple)) else [cfg]):
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return (ids[0] if ids else None), ids[1:]
