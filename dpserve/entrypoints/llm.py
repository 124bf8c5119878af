"""The offline API: `LLM(...).generate(prompts, params)`, shaped like vLLM's.

It drives an in-process `EngineCore` directly; the server drives the same
core through sockets. Tokenising, chat templates, detokenising and stop
strings happen here, in the front-end, not in the engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from dpserve.config import ConfigError, EngineArgs, EngineConfig
from dpserve.engine.core import EngineCore
from dpserve.frontend.output_processor import OutputProcessor
from dpserve.frontend.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer
from dpserve.outputs import RequestOutput
from dpserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A prompt is text, or {"prompt_token_ids": [...]} (optionally with "prompt").
PromptType = str | dict[str, Any]


class LLM:
    """Generate text offline with one engine.

    `LLM()` serves the built-in default model; every engine option
    (see `EngineArgs`, or `dpserve generate --help`) is a keyword argument,
    and unknown ones fail with a message naming them.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if kwargs.get("data_parallel_size", 1) != 1:
            raise ConfigError(
                f"data_parallel_size must be 1 for the offline LLM (one in-process engine), "
                f"got {kwargs['data_parallel_size']!r}; serve several engines with "
                f"`dpserve serve --data-parallel-size N`")
        self.config: EngineConfig = EngineArgs.from_kwargs(model=model, **kwargs).create_config()
        self.tokenizer = load_tokenizer(self.config.model.tokenizer)
        self.engine = EngineCore(self.config)
        self.eos_token_id, extra_eos_ids = eos_token_ids(
            self.tokenizer, dict(self.config.model.hf_config))
        self._processor = OutputProcessor(self.tokenizer, self.eos_token_id, extra_eos_ids)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for `prompts`, returned in the same order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        ids = []
        for prompt, p in zip(prompts, params):
            text, token_ids = self._tokenize(prompt)
            ids.append(self._add(text, token_ids, p))
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = self._params_list(sampling_params, len(conversations))
        ids = []
        for conv, p in zip(conversations, params):
            token_ids = apply_chat_template(self.tokenizer, list(conv), add_generation_prompt,
                                            chat_template)
            ids.append(self._add(self.tokenizer.decode(token_ids), token_ids, p))
        return self._run(ids, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def get_stats(self) -> Any:
        return self.engine.get_stats()

    # ---- internals -------------------------------------------------------

    def _params_list(self, params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {n} prompts but {len(params)} sampling params")
        return params

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError("a prompt must be a string or a dict with 'prompt_token_ids'")

    def _add(self, text: str | None, token_ids: list[int], params: SamplingParams) -> str:
        request_id = str(next(self._counter))
        engine_requests = self._processor.add_request(
            request_id, text, token_ids, params, arrival_time=time.monotonic())
        try:
            for req in engine_requests:
                self.engine.add_request(req)
        except ValueError:
            self._processor.abort_request(request_id)
            self.engine.abort_requests([r.request_id for r in engine_requests])
            raise
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(request_ids), use_tqdm)
        generated, start = 0, time.monotonic()
        try:
            while self.engine.has_unfinished_requests():
                engine_outputs = self.engine.step()
                generated += sum(len(o.new_token_ids) for o in engine_outputs)
                processed = self._processor.process_outputs(engine_outputs)
                if processed.reqs_to_abort:
                    self.engine.abort_requests(processed.reqs_to_abort)
                for out in processed.request_outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    bar.set_postfix_str(f"{generated / (time.monotonic() - start):.1f} tok/s",
                                        refresh=False)
        except BaseException:
            # Leave the engine clean for the next call (e.g. after Ctrl-C).
            pending = [r for r in request_ids if r not in finished]
            for rid in pending:
                self.engine.abort_requests(self._processor.engine_request_ids(rid))
                self._processor.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
