"""The front-end's tokenizer load takes a short cut for plain Llama directories
(`dpserve.frontend.tokenizer._plain_llama_backend`): it must give what
AutoTokenizer gives, and other models must still go through AutoTokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dpserve.checkpoint.loader import resolve_model
from dpserve.frontend.tokenizer import _load, _plain_llama_backend

TEXTS = ["Hello world", " spaced  text\n\tnew line", "ünïcode 😀 and digits 12345",
         "<|im_start|>user\nhi<|im_end|>", ""]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there! <|im_end|> ünïcode"}]


def _same_tokenizer(path: str) -> None:
    ours, auto = _load(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    assert len(ours) == len(auto)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == \
            auto.encode(text, add_special_tokens=False), text
    ids = auto.encode(" ".join(TEXTS))
    assert ours.decode(ids) == auto.decode(ids)
    assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "all_special_ids", "chat_template", "model_max_length"):
        assert getattr(ours, attr) == getattr(auto, attr), attr


@pytest.mark.parametrize("model", ["tiny_llama",
                                   pytest.param("default", marks=pytest.mark.slow)])
def test_the_short_cut_loads_what_auto_tokenizer_loads(model, request):
    path = str(resolve_model(None) if model == "default" else request.getfixturevalue(model))
    assert _plain_llama_backend(path)
    _same_tokenizer(path)


def test_other_models_go_through_auto_tokenizer(tiny_qwen2, tmp_path):
    assert not _plain_llama_backend(str(tiny_qwen2))  # AutoTokenizer picks Qwen2Tokenizer
    assert not _plain_llama_backend(str(tmp_path))  # no files at all
    _same_tokenizer(str(tiny_qwen2))
