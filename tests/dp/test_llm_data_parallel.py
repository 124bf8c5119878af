"""Offline data parallel: `LLM(model, data_parallel_size=2)` over real engine
processes and the DP coordinator. Results equal one in-process engine, in
prompt order; the load reaches both engines and a pinned rank is honoured
(checked with each engine's own prefix-cache lookup counter); bad input fails
as with one engine; Ctrl-C leaves the LLM usable; a SIGKILLed or crashing
engine makes generate raise EngineDeadError, not hang; and no process
outlives shutdown()."""

from __future__ import annotations

import gc
import signal
import time

import psutil
import pytest
import torch
from helpers import nonblank_stop_string

from dpserve import LLM, SamplingParams
from dpserve.config import ConfigError
from dpserve.engine.build import FAULT_FORWARD_ENV
from dpserve.frontend.errors import EngineDeadError

PROMPTS = [f"{word} {i}" for i, word in enumerate(
    ["Hello", "Once upon a time", "def add(x, y):", "The quick brown fox", "1 2 3 4"] * 4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
pytestmark = pytest.mark.procs

DP_KWARGS = dict(data_parallel_size=2, max_model_len=256)  # 2 cores: 1 thread per engine


def _engine_children() -> list[psutil.Process]:
    """This process's dpserve children (not multiprocessing's resource tracker)."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.name().startswith("dpserve::")]


def _pids() -> set[int]:
    """The pids of this process's dpserve children (the module's LLM may hold some)."""
    return {p.pid for p in _engine_children()}


def _all_gone(procs: list[psutil.Process], timeout: float = 10.0) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive


def _lookups(llm: LLM) -> list[int]:
    """Prompt tokens each engine has looked up in its prefix cache (one count per request)."""
    return [llm.get_stats(rank).prefix_cache_queries for rank in range(llm.data_parallel_size)]


def _prompt_tokens(llm: LLM, prompts: list[str]) -> int:
    return sum(len(llm.get_tokenizer().encode(p)) for p in prompts)


def _summary(outputs) -> list:
    """Everything user-visible but the logprob floats (checked with a tolerance)."""
    return [(o.prompt, o.prompt_token_ids, o.finished,
             [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
               None if c.logprobs is None else [sorted(lp) for lp in c.logprobs])
              for c in o.outputs]) for o in outputs]


@pytest.fixture(scope="module")
def one_engine(tiny_llama):
    threads = torch.get_num_threads()
    try:  # one torch thread, as each of the two engines has: the same arithmetic
        yield LLM(str(tiny_llama), threads_per_engine=1, max_model_len=256)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dp_llm(tiny_llama):
    llm = LLM(str(tiny_llama), **DP_KWARGS)
    yield llm
    llm.shutdown()


def test_greedy_outputs_equal_one_engine_and_both_engines_serve(dp_llm, one_engine):
    expected = one_engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    before = _lookups(dp_llm)
    got = dp_llm.generate(PROMPTS, GREEDY)  # with the progress bar
    served = [a - b for a, b in zip(_lookups(dp_llm), before)]
    assert [o.prompt for o in got] == PROMPTS
    assert _summary(got) == _summary(expected)
    assert sum(served) == _prompt_tokens(dp_llm, PROMPTS)  # every request ran once
    assert all(n > 0 for n in served), served  # on both engines


def test_pinned_rank_is_honoured(dp_llm, one_engine):
    prompts = PROMPTS[:6]
    for rank in (0, 1):
        before = _lookups(dp_llm)
        got = dp_llm.generate(prompts, GREEDY, use_tqdm=False, data_parallel_rank=rank)
        served = [a - b for a, b in zip(_lookups(dp_llm), before)]
        assert served[rank] == _prompt_tokens(dp_llm, prompts) and served[1 - rank] == 0
        assert _summary(got) == _summary(one_engine.generate(prompts, GREEDY, use_tqdm=False))
    # One rank per prompt (None: the balancer's choice).
    before = _lookups(dp_llm)
    dp_llm.generate(prompts[:3], GREEDY, use_tqdm=False, data_parallel_rank=[1, None, 1])
    served = [a - b for a, b in zip(_lookups(dp_llm), before)]
    assert served[1] >= _prompt_tokens(dp_llm, [prompts[0], prompts[2]])
    with pytest.raises(ValueError, match="data_parallel_rank 2 is out of range"):
        dp_llm.generate(prompts, GREEDY, use_tqdm=False, data_parallel_rank=2)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        dp_llm.generate(prompts, GREEDY, use_tqdm=False, data_parallel_rank=[0])


def test_sampling_features_equal_one_engine(dp_llm, one_engine):
    text = one_engine.generate(["Hello world"], SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = nonblank_stop_string(text, 2)
    params = [
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                       include_stop_str_in_output=True),
    ]
    prompts = ["Hello world"] * len(params)
    expected = one_engine.generate(prompts, params, use_tqdm=False)
    got = dp_llm.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    assert len({tuple(c.token_ids) for c in got[0].outputs}) > 1  # n: distinct samples
    assert got[2].outputs[0].finish_reason == "stop"
    for g, e in zip(got[1].outputs[0].logprobs, expected[1].outputs[0].logprobs):
        assert {t: lp.logprob for t, lp in g.items()} == pytest.approx(
            {t: lp.logprob for t, lp in e.items()}, abs=1e-4)
    chat = [[{"role": "user", "content": "Name three colours."}],
            [{"role": "user", "content": "Hi"}]]
    assert _summary(dp_llm.chat(chat, GREEDY, use_tqdm=False)) == _summary(
        one_engine.chat(chat, GREEDY, use_tqdm=False))


def test_bad_input_fails_as_with_one_engine(dp_llm, one_engine):
    bad = [{"prompt_token_ids": [5] * 256}, {"prompt_token_ids": [10**6]},
           {"prompt_token_ids": []}, {"prompt_token_ids": [1.5]}, 42]
    for prompt in bad:
        with pytest.raises(ValueError) as one:
            one_engine.generate(["Hello", prompt], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError) as dp:
            dp_llm.generate(["Hello", prompt], GREEDY, use_tqdm=False)
        assert str(dp.value) == str(one.value)
    with pytest.raises(ValueError, match="sampling params"):
        dp_llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    # Nothing was left behind: the next call runs only its own request.
    assert not dp_llm.engine.has_unfinished_requests()
    assert dp_llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].finished


def test_interrupted_generate_leaves_the_llm_usable(dp_llm, one_engine, monkeypatch):
    step = dp_llm.engine.step

    def interrupted_step():
        outputs = step()
        if outputs:
            raise KeyboardInterrupt  # as Ctrl-C in the middle of a run
        return outputs

    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with monkeypatch.context() as m:
        m.setattr(dp_llm.engine, "step", interrupted_step)
        with pytest.raises(KeyboardInterrupt):
            dp_llm.generate(PROMPTS, long, use_tqdm=False)
    assert not dp_llm.engine.has_unfinished_requests()
    assert _summary(dp_llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)) == _summary(
        one_engine.generate(PROMPTS[:4], GREEDY, use_tqdm=False))
    deadline = time.monotonic() + 30  # the aborted requests leave the engines
    while any(dp_llm.get_stats(r).num_running + dp_llm.get_stats(r).num_waiting
              for r in (0, 1)):
        assert time.monotonic() < deadline, "aborted requests still in the engines"
        time.sleep(0.1)


def test_shutdown_stops_every_process(tiny_llama):
    # An LLM of its own: shutting down the module's would break the tests after it.
    before = _pids()
    llm = LLM(str(tiny_llama), **DP_KWARGS)
    children = [p for p in _engine_children() if p.pid not in before]
    names = {p.name().removeprefix("dpserve::") for p in children}
    assert {"EngineCore_0", "EngineCore_1", "DPCoordinator"} <= names, names
    llm.shutdown()
    assert _all_gone(children), [p for p in children if p.is_running()]
    assert _pids() <= before
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hello"], GREEDY, use_tqdm=False)


def test_a_killed_engine_is_survived_offline(tiny_llama, one_engine, monkeypatch):
    """Default policy (restart): a SIGKILL mid-run moves its requests to the other
    engine; generate() returns what one undisturbed engine returns; it restarts."""
    before = _pids()
    with LLM(str(tiny_llama), **DP_KWARGS) as llm:
        victim = next(p for p in _engine_children()
                      if p.pid not in before and p.name() == "dpserve::EngineCore_1")
        step = llm.engine.step

        def killing_step():
            outputs = step()
            if outputs and victim.is_running():
                victim.send_signal(signal.SIGKILL)  # mid-run, tokens flowing
            return outputs

        monkeypatch.setattr(llm.engine, "step", killing_step)
        long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        got = llm.generate(PROMPTS[:8], long, use_tqdm=False)
        assert not victim.is_running()
        assert _summary(got) == _summary(one_engine.generate(PROMPTS[:8], long,
                                                             use_tqdm=False))
        assert llm.engine.client.book.num_migrations + llm.engine.client.book.num_retries > 0
        deadline = time.monotonic() + 60
        while not llm.engine.client.engines[1].serving:  # back as a new process
            assert time.monotonic() < deadline, llm.engine.client.describe_ranks()
            time.sleep(0.1)
        assert llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, data_parallel_rank=1)


@pytest.mark.parametrize("death", ["sigkill", "fatal-error"])
def test_policy_stop_raises_engine_dead_error(tiny_llama, monkeypatch, death):
    if death == "fatal-error":  # every engine's 3rd forward raises: ENGINE_CORE_DEAD
        monkeypatch.setenv(FAULT_FORWARD_ENV, "3")
    before = _pids()
    with LLM(str(tiny_llama), data_parallel_size=2, max_model_len=1024,
             engine_failure_policy="stop") as llm:
        children = [p for p in _engine_children() if p.pid not in before]
        victim = next(p for p in children if p.name() == "dpserve::EngineCore_1")
        step = llm.engine.step
        killed: list[bool] = []

        def killing_step():
            outputs = step()
            if outputs and death == "sigkill" and not killed:  # once: it may be reaped next
                killed.append(True)
                victim.send_signal(signal.SIGKILL)  # mid-run, tokens flowing
            return outputs

        monkeypatch.setattr(llm.engine, "step", killing_step)
        long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        with pytest.raises(EngineDeadError, match=r"EngineCore_\d|engine \d|ENGINE_CORE_DEAD"):
            llm.generate(PROMPTS[:8], long, use_tqdm=False)
        # The other processes were stopped, and later calls fail at once.
        assert _all_gone(children), [p for p in children if p.is_running()]
        with pytest.raises(EngineDeadError):
            llm.generate(["Hello"], GREEDY, use_tqdm=False)


def test_lockstep_and_secret_then_garbage_collection(tiny_llama, one_engine):
    # The serve options that change the engines' protocol work offline too; then
    # dropping the last reference stops every process.
    before = _pids()
    llm = LLM(str(tiny_llama), data_parallel_lockstep=True,
              data_parallel_secret="offline-secret-of-32-characters-or-more", **DP_KWARGS)
    children = [p for p in _engine_children() if p.pid not in before]
    assert len(children) == 3 and llm.engine.client.lockstep
    assert _summary(llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)) == _summary(
        one_engine.generate(PROMPTS[:6], GREEDY, use_tqdm=False))
    del llm
    gc.collect()
    assert _all_gone(children), [p for p in children if p.is_running()]


def test_one_engine_runs_in_process(tiny_llama):
    before = _pids()
    llm = LLM(str(tiny_llama), max_model_len=256)
    assert _pids() == before
    assert llm.generate(["Hello"], GREEDY, use_tqdm=False, data_parallel_rank=0)[0].finished
    with pytest.raises(ValueError, match="data_parallel_rank 1 is out of range"):
        llm.generate(["Hello"], GREEDY, use_tqdm=False, data_parallel_rank=1)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hello"], GREEDY, use_tqdm=False)


def test_unsupported_parallel_options_are_config_errors(tiny_llama):
    before = _pids()
    with pytest.raises(ConfigError, match="data_parallel_size"):
        LLM(str(tiny_llama), data_parallel_size=0)
    with pytest.raises(ConfigError, match="data_parallel_size_local"):
        LLM(str(tiny_llama), data_parallel_size=2, data_parallel_size_local=1)
    with pytest.raises(ConfigError, match="data_parallel_backend"):
        LLM(str(tiny_llama), data_parallel_size=2, data_parallel_backend="ray")
    assert _pids() == before
