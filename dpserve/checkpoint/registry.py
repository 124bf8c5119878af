"""Model architectures by name, imported only when chosen.

The key is the `architectures` entry of a Hugging Face config.json; the value
names the module and class that implement it.
"""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("dpserve.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("dpserve.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("dpserve.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("dpserve.model.moe_models", "MoEForCausalLM"),
    "MixtralForCausalLM": ("dpserve.model.moe_models", "MoEForCausalLM"),
    "Qwen2MoeForCausalLM": ("dpserve.model.moe_models", "MoEForCausalLM"),
    "Qwen3MoeForCausalLM": ("dpserve.model.moe_models", "MoEForCausalLM"),
    "OlmoeForCausalLM": ("dpserve.model.moe_models", "MoEForCausalLM"),
}


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Add (or replace) an architecture; the module is imported on first use."""
    _MODELS[architecture] = (module, class_name)


def supports_int8(architecture: str) -> bool:
    """Whether `--quantization int8` serves it: the dense Llama family's class
    (read from the table: the check imports no torch model code)."""
    return _MODELS.get(architecture) == ("dpserve.model.llama", "LlamaForCausalLM")


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
