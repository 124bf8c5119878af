"""Config: unknown and invalid options fail with a message naming the option."""

from pathlib import Path

import pytest

from dpserve.config import ConfigError, EngineArgs, parse_memory_size
from dpserve.sampling_params import SamplingParams


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="unknown option 'max_num_seq'"):
        EngineArgs.from_kwargs(max_num_seq=4)


@pytest.mark.parametrize("kwargs, name", [
    ({"dtype": "float8"}, "dtype"),
    ({"block_size": 3}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"kv_offload_memory": "lots"}, "kv_offload_memory"),
    ({"kv_offload_memory": "-1GiB"}, "kv_offload_memory"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"data_parallel_size": 0}, "data_parallel_size"),
    ({"threads_per_engine": 0}, "threads_per_engine"),
])
def test_invalid_option_is_named(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        EngineArgs.from_kwargs(**kwargs).create_config()


def test_config_is_frozen(tiny_llama):
    config = EngineArgs.from_kwargs(model=str(tiny_llama), max_model_len=128).create_config()
    assert config.model.max_model_len == 128 == config.scheduler.max_model_len
    assert config.model.architecture == "LlamaForCausalLM"
    with pytest.raises(AttributeError):
        config.model.max_model_len = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.model.hf_config["vocab_size"] = 1  # type: ignore[index]


def test_cpu_step_budget_defaults_to_512(tiny_llama):
    """On CPU a step's token budget is 512 (at least max_num_seqs), unless set or
    the engines step in lockstep."""
    def budget(**kw) -> int:
        return EngineArgs.from_kwargs(model=str(tiny_llama), device="cpu",
                                      **kw).create_config().scheduler.max_num_batched_tokens
    assert budget() == 512
    assert budget(max_num_seqs=600) == 600
    assert budget(max_num_batched_tokens=4096) == 4096
    # Lockstep engines pay a collective every step: fewer, larger steps.
    assert budget(data_parallel_size=2, data_parallel_lockstep=True) == 2048


def test_max_model_len_over_model_context(tiny_llama):
    with pytest.raises(ConfigError, match="max_model_len"):
        EngineArgs.from_kwargs(model=str(tiny_llama), max_model_len=10**6).create_config()


def test_kv_offload_memory_needs_prefix_caching_and_the_mp_backend():
    with pytest.raises(ConfigError, match="kv_offload_memory needs prefix caching.*"
                       "--no-enable-prefix-caching or --kv-offload-memory"):
        EngineArgs.from_kwargs(kv_offload_memory="1GiB", enable_prefix_caching=False
                               ).check_options()
    with pytest.raises(ConfigError, match="kv_offload_memory: not with the Ray backend yet"):
        EngineArgs.from_kwargs(kv_offload_memory="1GiB", data_parallel_backend="ray",
                               data_parallel_size=2).check_options()
    # Off (unset or 0): nothing to check, prefix caching or not.
    EngineArgs.from_kwargs(kv_offload_memory="0", enable_prefix_caching=False).check_options()


def test_kv_offload_memory_reaches_the_cache_config(tiny_llama):
    def cache(**kw):
        return EngineArgs.from_kwargs(model=str(tiny_llama), device="cpu",
                                      **kw).create_config().cache
    assert cache(kv_offload_memory="64MiB").kv_offload_bytes == 64 << 20
    assert cache().kv_offload_bytes is None and cache(kv_offload_memory=0).kv_offload_bytes \
        is None
    assert cache(kv_offload_memory="64MiB").kv_tier_address is None  # the launcher's to set


def test_memory_sizes():
    assert parse_memory_size("2GiB", "x") == 2 << 30
    assert parse_memory_size("512 MiB", "x") == 512 << 20
    assert parse_memory_size(1000, "x") == 1000
    with pytest.raises(ConfigError, match="opt"):
        parse_memory_size("-1", "opt")


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"), ({"logprobs": 21}, "logprobs"), ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"stop": [""]}, "stop"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"seed": 1 << 64}, "seed"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_stop_string_becomes_list():
    assert SamplingParams(stop="x").stop == ["x"]


def test_config_pickles_for_spawned_engines(tiny_llama):
    import pickle

    config = EngineArgs.from_kwargs(model=str(tiny_llama)).create_config()
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config
    with pytest.raises(TypeError):
        copy.model.hf_config["vocab_size"] = 1  # type: ignore[index]


def test_data_parallel_threads_share_the_cores(tiny_llama, monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    config = EngineArgs.from_kwargs(model=str(tiny_llama), data_parallel_size=3,
                                    device="cpu").create_config()
    assert config.parallel.data_parallel_size == 3
    assert config.parallel.threads_per_engine == 2  # 8 cores // 3 engines
    config = EngineArgs.from_kwargs(model=str(tiny_llama), data_parallel_size=3,
                                    threads_per_engine=1, device="cpu").create_config()
    assert config.parallel.threads_per_engine == 1  # the user's choice wins
    config = EngineArgs.from_kwargs(model=str(tiny_llama), device="cpu").create_config()
    assert config.parallel.threads_per_engine is None  # one engine: torch's default


def test_cpu_bind_shares_out_the_cores(tiny_llama, monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 8, 9})

    def groups(**kwargs):
        return EngineArgs.from_kwargs(model=str(tiny_llama), device="cpu",
                                      **kwargs).create_config().parallel.cpu_groups

    # auto: each local engine its share of the allowed cores, in order
    assert groups(data_parallel_size=3) == ((0, 1), (2, 3), (4, 5))
    assert groups(data_parallel_size=2, threads_per_engine=4) == ((0, 1, 2, 3), (4, 5, 8, 9))
    # ... but not one engine, fewer threads than cores (a second server would be bound
    # to the same cores), oversubscribed cores, Ray, or 'none'
    assert groups() is None
    assert groups(data_parallel_size=2, threads_per_engine=1) is None
    assert groups(data_parallel_size=2, threads_per_engine=8) is None
    assert groups(data_parallel_size=2, data_parallel_backend="ray") is None
    assert groups(data_parallel_size=2, cpu_bind="none") is None
    # this host's engines only (multi-host)
    assert groups(data_parallel_size=4, data_parallel_size_local=2,
                  data_parallel_start_rank=2) == ((0, 1, 2, 3), (4, 5, 8, 9))
    assert groups(data_parallel_size=2, cpu_bind="0-1,8|9") == ((0, 1, 8), (9,))
    for spec, message in [("0|1|2", "names 3 core list"), ("0|7", r"core\(s\) \[7\]"),
                          ("0|a", "not a core list"), ("3-1|0", "not a core list"),
                          ("", "cpu_bind")]:
        with pytest.raises(ConfigError, match=message):
            groups(data_parallel_size=2, cpu_bind=spec)
    with pytest.raises(ConfigError, match="cpu_bind.*Ray places"):
        groups(data_parallel_size=2, data_parallel_backend="ray", cpu_bind="0|1")


def test_vllm_short_flags_are_aliases():
    """-dp, -dpl, -dpr, -dpa, -dpp, -dpn, -dph, -dpb parse as vLLM's long options."""
    import argparse

    from dpserve.entrypoints.serve import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    short = parser.parse_args(["m", "-dp", "4", "-dpl", "2", "-dpr", "2", "-dpa", "10.0.0.1",
                               "-dpp", "1234", "-dph", "-dpb", "mp"])
    long = parser.parse_args(["m", "--data-parallel-size", "4", "--data-parallel-size-local",
                              "2", "--data-parallel-start-rank", "2",
                              "--data-parallel-address", "10.0.0.1",
                              "--data-parallel-rpc-port", "1234", "--data-parallel-hybrid-lb",
                              "--data-parallel-backend", "mp"])
    assert vars(short) == vars(long)
    args = EngineArgs.from_cli(short)
    assert (args.data_parallel_size, args.data_parallel_size_local,
            args.data_parallel_start_rank, args.data_parallel_address,
            args.data_parallel_rpc_port, args.data_parallel_hybrid_lb) == (
        4, 2, 2, "10.0.0.1", 1234, True)
    assert EngineArgs.from_cli(parser.parse_args(["m", "-dp", "2", "-dpn", "1"])
                               ).data_parallel_rank == 1


def test_cli_refuses_a_python_older_than_the_minimum(monkeypatch, capsys):
    """One line naming the version needed and why (CVE-2022-42919 forkservers); the
    minimum raised past this interpreter stands in for an old one."""
    from dpserve import cli

    pyproject = Path(cli.__file__).parents[1].joinpath("pyproject.toml").read_text()
    minimum = ".".join(map(str, cli.MIN_PYTHON))
    assert f'\nrequires-python = ">={minimum}"\n' in pyproject  # one minimum, two places
    monkeypatch.setattr(cli, "MIN_PYTHON", (99, 0, 0))
    assert cli.main(["serve", "--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("dpserve: error: Python 99.0.0 or newer")
    assert "CVE-2022-42919" in err
