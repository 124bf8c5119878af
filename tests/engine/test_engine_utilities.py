"""The engine's utility table (`dpserve.engine.utilities`), in process.

* `UtilityTable`: a name is registered once; a name not registered is refused by
  name (AttributeError, what the engine process answers with);
* an `EngineCore` serves exactly the utilities front-ends call (its views, the
  workers', LoRA's) and nothing of the request path; with LoRA off, its calls
  say so in one line and `list_loras` is empty.
"""

from __future__ import annotations

import os

import pytest

from dpserve import LLM
from dpserve.engine.utilities import UtilityTable

SERVED = {"get_stats", "get_request_counts", "reset_prefix_cache", "request_state_sizes",
          "start_profile", "stop_profile", "save_sharded_state", "tp_worker_info",
          "expert_info", "add_lora", "remove_lora", "list_loras", "pin_lora"}


def test_table_registers_once_and_refuses_unknown_names():
    table = UtilityTable()
    table.register(double=lambda x: 2 * x)
    assert "double" in table and table.call("double", 21) == 42
    with pytest.raises(ValueError, match="'double' is registered twice"):
        table.register(double=lambda x: x)
    with pytest.raises(AttributeError, match="no utility method 'triple'"):
        table.call("triple", 1)
    assert table.names() == {"double"}


def test_engine_core_serves_its_features_calls(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32)
    core = llm.engine
    try:
        assert core.utilities.names() == SERVED
        assert not {"step", "add_request", "abort_requests", "sleep", "wake_up",
                    "shutdown", "execute_dummy_batch"} & core.utilities.names()
        assert core.call_utility("get_request_counts") == (0, 0)
        assert core.call_utility("expert_info") is None  # a dense model
        assert [w.pid for w in core.call_utility("tp_worker_info")] == [os.getpid()]
        assert core.call_utility("list_loras") == []
        with pytest.raises(ValueError, match="LoRA is not enabled on this engine"):
            core.call_utility("add_lora", "a", "/nowhere")
        assert core.call_utility("request_state_sizes")["lora_requests"] == 0
    finally:
        llm.shutdown()
