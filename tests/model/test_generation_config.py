"""--generation-config auto|vllm|DIR: the model's generation_config.json supplies the
defaults of requests that do not set them (vLLM's behaviour), offline and served."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from helpers import output, serve

from dpserve import LLM, SamplingParams
from dpserve.config import ConfigError, EngineArgs

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def greedy_model(tiny_llama, tmp_path_factory):
    """The tiny model with a generation_config.json asking for greedy, 3 new tokens."""
    path = tmp_path_factory.mktemp("genconf") / "model"
    shutil.copytree(tiny_llama, path)
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 3, "do_sample": True,
         "eos_token_id": 2}))
    return path


def texts(llm: LLM, times: int) -> set[tuple[int, ...]]:
    outs = llm.generate([PROMPT] * times, use_tqdm=False)
    return {tuple(o.outputs[0].token_ids) for o in outs}


def test_offline_auto_and_vllm(greedy_model) -> None:
    llm = LLM(str(greedy_model), max_num_seqs=4)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_p=0.9,
                                                               max_tokens=3)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert texts(llm, 4) == {tuple(greedy)}  # deterministic, 3 tokens, no params given
    del llm
    ignored = LLM(str(greedy_model), max_num_seqs=4, generation_config="vllm")
    assert ignored.get_default_sampling_params() == SamplingParams()
    assert len(texts(ignored, 4)) > 1  # temperature 1: samples differ
    with pytest.raises(ConfigError, match="generation_config"):
        EngineArgs(model=str(greedy_model), generation_config="/nonexistent").create_config()


def test_bad_generation_config_is_a_config_error(greedy_model, tmp_path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"temperature": 9.0}))
    with pytest.raises(ConfigError, match="temperature"):
        EngineArgs(model=str(greedy_model), generation_config=str(bad)).create_config()


@pytest.mark.procs
def test_server_applies_and_logs_defaults(greedy_model) -> None:
    with serve(str(greedy_model), "--served-model-name", "tiny") as (proc, url):
        body = {"model": "tiny", "prompt": PROMPT["prompt_token_ids"]}
        got = {httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
               for _ in range(3)}
        explicit = httpx.post(url + "/v1/completions", json={**body, "temperature": 0,
                                                              "max_tokens": 3}).json()
        assert got == {explicit["choices"][0]["text"]}
        # A request's own values win over the defaults.
        long = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 6,
                                                          "ignore_eos": True}).json()
        assert long["usage"]["completion_tokens"] == 6
        chat = httpx.post(url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 3  # max_new_tokens
        log = output(proc)
    assert "generation_config.json" in log and "temperature=0.0" in log
    assert "max_tokens=3" in log
