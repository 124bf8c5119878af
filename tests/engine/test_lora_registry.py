"""The DP-wide LoRA load of `dpserve.frontend.lora` over two real engines (in-process
`EngineCore`s on the tiny Llama, each behind an `InprocEngineClient`) whose LoRA
options differ, so that one rank alone refuses an adapter: the load is rolled back
on the rank that took it, the 400 names the refusing rank and the problem, and the
registry is unchanged; a good adapter loads on both and unloads from both.

`TwoRanks` is a named stand-in for the socket client's `ClusterView`: it only routes
each utility call to the engine of that rank and keeps the registry copy (as the
engine client does without a coordinator); the engines and their refusals are real.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from lora_checks import make_adapter

from dpserve.config import EngineArgs
from dpserve.frontend.lora import LoRAError, load_adapter, unload_adapter
from dpserve.frontend.rank_table import RankView
from dpserve.protocol import LoRAChange, RankState
from dpserve.testing.inproc_client import InprocEngineClient


class TwoRanks:
    """Two in-process engines as ranks 0 and 1 (module docstring)."""

    def __init__(self, engines: list[InprocEngineClient]) -> None:
        self.engines = engines
        self.loras: dict[str, str] | None = {}

    def ranks(self) -> list[RankView]:
        return [RankView(r, RankState.SERVING) for r in range(len(self.engines))]

    async def call_utility(self, method: str, *args: Any, engine: int | None = None,
                           timeout: float = 30.0) -> Any:
        return await self.engines[engine or 0].call_utility(method, *args, timeout=timeout)

    async def change_lora(self, change: LoRAChange) -> None:
        assert self.loras is not None
        if change.op == "add":
            self.loras[change.name] = change.path
        else:
            self.loras.pop(change.name, None)


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_registry")
    adapters = {"r4": make_adapter(tiny_llama, root / "r4", rank=4, seed=1),
                "r8": make_adapter(tiny_llama, root / "r8", rank=8, seed=2)}
    engines = [InprocEngineClient(EngineArgs(
        model=str(tiny_llama), num_kv_blocks=64, enable_lora=True,
        max_lora_rank=max_rank).create_config()) for max_rank in (16, 4)]
    yield TwoRanks(engines), adapters
    for engine in engines:
        engine.shutdown()


async def _names(cluster: TwoRanks) -> list[list[str]]:
    return [[e["name"] for e in await engine.call_utility("list_loras")]
            for engine in cluster.engines]


def test_one_rank_refusing_rolls_the_load_back_everywhere(setup):
    cluster, adapters = setup

    async def run() -> None:
        with pytest.raises(LoRAError) as e:
            await load_adapter(cluster, "big", str(adapters["r8"]))
        assert e.value.status == 400 and e.value.code == "invalid_lora_adapter"
        assert "rank 1:" in str(e.value) and "exceeds max_lora_rank 4" in str(e.value)
        assert await _names(cluster) == [[], []]  # rank 0 had loaded it: unloaded again
        assert cluster.loras == {}
        # A good one loads on both; its name is then taken (400) until unloaded (404 after).
        await load_adapter(cluster, "small", str(adapters["r4"]))
        assert await _names(cluster) == [["small"], ["small"]]
        assert cluster.loras == {"small": str(adapters["r4"])}
        with pytest.raises(LoRAError) as e:
            await load_adapter(cluster, "small", str(adapters["r4"]))
        assert e.value.status == 400 and "already been loaded" in str(e.value)
        await unload_adapter(cluster, "small")
        assert await _names(cluster) == [[], []] and cluster.loras == {}
        with pytest.raises(LoRAError) as e:
            await unload_adapter(cluster, "small")
        assert e.value.status == 404 and e.value.code == "lora_not_found"

    asyncio.run(run())


def test_lora_off_is_a_400(setup):
    cluster, _ = setup
    cluster.loras, saved = None, cluster.loras
    try:
        with pytest.raises(LoRAError) as e:
            asyncio.run(load_adapter(cluster, "x", "/nowhere"))
        assert e.value.status == 400 and "--enable-lora" in str(e.value)
    finally:
        cluster.loras = saved
