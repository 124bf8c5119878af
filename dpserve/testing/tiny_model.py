"""Build tiny random-weight checkpoints on the fly, in the Hugging Face layout.

`make_tiny_model(path, arch)` writes config.json, model.safetensors and a
small byte-level BPE tokenizer (trained here, with a ChatML chat template), so
tests get a real, loadable model in about a second without any download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, how are you today? I am fine, thank you.",
    "def add(x, y):\n    return x + y\n",
    "Data parallel serving runs several replicas of one model.",
    "Once upon a time there was a little engine that could.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
]
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_ARCH = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    # Mixture of experts: 8 experts (so each of 2 or 4 expert-parallel ranks holds some)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 96, "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True, "head_dim": 16}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False,
               "clip_qkv": 4.0}),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def make_tokenizer(path: Path, vocab_size: int = 384):
    """Train a byte-level BPE tokenizer and save it (tokenizer.json + config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0,
                    **overrides: Any) -> Path:
    """Write a tiny random `arch` checkpoint (a key of `_ARCH`) to `path`."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(path)
    config_cls, model_cls, extra = _ARCH[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.2, **extra)
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path
