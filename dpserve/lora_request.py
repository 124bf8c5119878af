"""`LoRARequest`: the LoRA adapter an offline request runs with (vLLM's shape).

`LLM.generate(..., lora_request=LoRARequest("name", 1, "/path/to/adapter"))`
loads the adapter into the engine(s) the first time a name is seen (the
engine's `add_lora`), then the request runs with it. `lora_int_id` is kept for
vLLM compatibility; the engine assigns its own ids, and names identify adapters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest needs a non-empty lora_name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got "
                             f"{self.lora_int_id!r}")
