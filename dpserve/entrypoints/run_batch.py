"""`dpserve run-batch -i in.jsonl -o out.jsonl [model] [engine options]`: an OpenAI
batch file run offline (vLLM's `vllm run-batch` names), with a progress bar.

The input is the Batch API's JSONL (`dpserve.server.batches.format`: chat and
completion lines, mixed as they like); every line is checked before the model
loads (a bad line is a one-line error naming it, exit 2). The lines then run
through the offline `LLM` (one engine, or `--data-parallel-size N` engine
processes), all at once, with tqdm's bar counting finished requests; the output
file gets one line per input line, in input order, in the Batch API's output
format, the bodies shaped as the server's (`dpserve.server.openai.protocol`). A line the
offline path cannot take (a field it does not support, an unknown model name, a
prompt over the context, /v1/embeddings) gets an error line with a 4xx status
naming the field; the others run.

Supported request fields: `SUPPORTED`. Sampling defaults come from the model's
generation_config.json, as in the server. Prompts are rendered as the server
renders them (the chat template over text messages; a completion prompt's text
or token ids), so a greedy line answers as the server's endpoint does.

Not here: the server's /v1/batches (`dpserve.server.batches.routes`).
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from dpserve.config import ConfigError, EngineArgs
from dpserve.frontend.tokenizer import apply_chat_template
from dpserve.outputs import RequestOutput
from dpserve.prompt import PromptError, check_prompt
from dpserve.sampling_params import SamplingParams
from dpserve.server.batches.format import (
    CHAT,
    COMPLETIONS,
    BatchLine,
    check_file,
    error_body,
    failed_line,
    output_line,
    parse_line,
    read_lines,
)
from dpserve.server.errors import APIError, to_api_error
from dpserve.server.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)

SUPPORTED = frozenset({
    "model", "messages", "prompt", "n", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
    "include_stop_str_in_output", "skip_special_tokens", "user", "stream",
    "add_generation_prompt"})
_PENALTIES = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
              "frequency_penalty", "repetition_penalty")


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face directory, .gguf file or hub name (default: "
                             "built-in SmolLM2-135M-Instruct)")
    parser.add_argument("-i", "--input-file", required=True,
                        help="The batch file (OpenAI's batch JSONL).")
    parser.add_argument("-o", "--output-file", required=True,
                        help="Where the results go (OpenAI's batch output JSONL).")
    parser.add_argument("--served-model-name", default=None, nargs="+",
                        help="Model names the lines may use (default: the model argument).")
    EngineArgs.add_cli_args(parser.add_argument_group("engine options"))


def run_batch(args: argparse.Namespace) -> int:
    """Check the file, run it, write the results: 0 (a failed line is a result too)."""
    from dpserve.entrypoints.llm import LLM

    _check_paths(args.input_file, args.output_file)
    total, errors = check_file(args.input_file, None)
    if errors:
        first = errors[0]
        where = f" line {first['line']}" if first["line"] else ""
        raise ConfigError(f"--input-file {args.input_file}{where}: {first['message']}"
                          + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
    engine_args = EngineArgs.from_cli(args)
    engine_args.check_options()
    names = args.served_model_name or [args.model or "SmolLM2-135M-Instruct"]
    with LLM(**vars(engine_args)) as llm:
        runs: list[_Run | dict[str, Any]] = [
            _prepare(llm, parse_line(text, number), names)
            for number, text in read_lines(args.input_file)]
        todo = [r for r in runs if isinstance(r, _Run)]
        outputs = llm.generate([{"prompt_token_ids": r.prompt_ids} for r in todo],
                               [r.params for r in todo], use_tqdm=True) if todo else []
    answers = iter(outputs)
    tmp = f"{args.output_file}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as out:
        for run in runs:
            line = run.answer(next(answers)) if isinstance(run, _Run) else run
            out.write(json.dumps(line) + "\n")
    os.replace(tmp, args.output_file)  # whole or not at all
    failed = sum(1 for r in runs if not isinstance(r, _Run))
    print(f"run-batch: {total} request(s), {failed} refused; results in {args.output_file}")
    return 0


def _check_paths(input_file: str, output_file: str) -> None:
    if not os.path.isfile(input_file):
        raise ConfigError(f"--input-file: no such file: {input_file}")
    folder = os.path.dirname(os.path.abspath(output_file))
    if not os.path.isdir(folder):
        raise ConfigError(f"--output-file: no such directory: {folder}")


@dataclass
class _Run:
    """A line that runs: its prompt and parameters, and how its answer is shaped."""

    line: BatchLine
    chat: bool
    model: str
    prompt_ids: list[int]
    params: SamplingParams

    def answer(self, out: RequestOutput) -> dict[str, Any]:
        usage = UsageInfo(prompt_tokens=len(out.prompt_token_ids),
                          completion_tokens=sum(len(c.token_ids) for c in out.outputs))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        body: BaseModel
        if self.chat:
            body = ChatCompletionResponse(
                id=f"chatcmpl-{uuid.uuid4().hex}", model=self.model, usage=usage, choices=[
                    ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                               finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    for c in out.outputs])
        else:
            body = CompletionResponse(
                id=f"cmpl-{uuid.uuid4().hex}", model=self.model, usage=usage, choices=[
                    CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                     stop_reason=c.stop_reason) for c in out.outputs])
        data = json.loads(body.model_dump_json())
        return output_line(self.line.custom_id, 200, data["id"], data)


def _prepare(llm: Any, line: BatchLine, names: list[str]) -> _Run | dict[str, Any]:
    """The line's run, or its error line; `names`: the model's (the first is reported)."""
    if line.url not in (CHAT, COMPLETIONS):
        return failed_line(line.custom_id, "unsupported_endpoint",
                           f"{line.url} is not supported by run-batch")
    try:
        return _run_of(llm, line, names)
    except (APIError, ValidationError, ValueError) as e:
        error = to_api_error(e)
        return output_line(line.custom_id, error.status_code, None, error_body(
            error.message, error.type, error.param, error.code))


def _run_of(llm: Any, line: BatchLine, names: list[str]) -> _Run:
    chat = line.url == CHAT
    kind = ChatCompletionRequest if chat else CompletionRequest
    req = kind.model_validate_json(json.dumps(line.body), strict=True)
    unsupported = sorted(req.model_fields_set - SUPPORTED)
    if unsupported or req.stream:
        name = unsupported[0] if unsupported else "stream"
        raise APIError(400, f"{name} is not supported by run-batch", param=name)
    if req.model is not None and req.model not in names:
        raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                       code="model_not_found")
    defaults = dict(llm.config.model.generation_defaults)
    if isinstance(req, ChatCompletionRequest):
        ids = _chat_prompt(llm, req)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        max_tokens = defaults.get("max_tokens") if max_tokens is None else max_tokens
    else:
        ids = _completion_prompt(llm, req.prompt)
        max_tokens = defaults.get("max_tokens", 16) if req.max_tokens is None else req.max_tokens
    given = {k: v for k, v in defaults.items() if k != "max_tokens"}
    given.update({k: getattr(req, k) for k in _PENALTIES if getattr(req, k) is not None})
    params = SamplingParams(n=req.n, max_tokens=max_tokens, seed=req.seed,
                            stop=list(req.stop or []),
                            stop_token_ids=list(req.stop_token_ids or []),
                            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                            include_stop_str_in_output=req.include_stop_str_in_output,
                            skip_special_tokens=req.skip_special_tokens, **given)
    try:
        check_prompt(ids, llm.config.model.max_model_len,
                     int(llm.config.model.hf_config["vocab_size"]), max_tokens=max_tokens)
    except PromptError as e:
        raise APIError(400, str(e), param="messages" if chat else e.param,
                       code=e.code) from None
    return _Run(line, chat, names[0], ids, params)


def _chat_prompt(llm: Any, req: ChatCompletionRequest) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content if isinstance(m.content, str) else ""
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise APIError(400, f"messages[{i}]: only text content parts are supported",
                               param="messages")
            content = "".join(p.text or "" for p in m.content)
        messages.append({"role": "system" if m.role == "developer" else m.role,
                         "content": content})
    try:
        return apply_chat_template(llm.get_tokenizer(), messages, req.add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - templates raise what they like on bad input
        raise APIError(400, f"cannot apply the chat template: {e}",
                       param="messages") from None


def _completion_prompt(llm: Any, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return llm.get_tokenizer().encode(prompt)
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise APIError(400, "run-batch takes one prompt per line (a string or token ids)",
                   param="prompt")
