"""LoRA test helpers: small PEFT adapters for tiny models, and PEFT's own greedy tokens."""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: Path, out: Path, rank: int = 8, alpha: float = 16.0, seed: int = 1,
                 targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False,
                 scale: float = 0.5) -> Path:
    """A PEFT LoRA adapter for the model in `base`, saved to `out`: random A and B (PEFT
    starts B at zero, which would change nothing), large enough to change greedy tokens."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        lora_dropout=0.0, use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(out)
    return out


_CACHE: dict[tuple[str, str | None], object] = {}


def peft_greedy(base: Path, adapter: Path | None, prompt_ids: list[int],
                max_tokens: int) -> list[int]:
    """Greedy tokens of transformers (+ PEFT with `adapter`), float32."""
    import torch
    from transformers import AutoModelForCausalLM

    key = (str(base), str(adapter) if adapter else None)
    model = _CACHE.get(key)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter)
        model = _CACHE[key] = model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                             do_sample=False, min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
