"""dpserve: a data-parallel LLM inference server.

Offline use::

    from dpserve import LLM, SamplingParams
    llm = LLM()  # the built-in SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpserve.lora_request import LoRARequest
from dpserve.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from dpserve.protocol import PoolingParams
from dpserve.sampling_params import SamplingParams
from dpserve.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "LoRARequest", "PoolingParams", "EmbeddingRequestOutput", "__version__"]

if TYPE_CHECKING:
    from dpserve.entrypoints.llm import LLM


def __getattr__(name: str):
    # LLM pulls in torch and the model code: import it only when asked for.
    if name == "LLM":
        from dpserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'dpserve' has no attribute {name!r}")
