"""Incremental detokenisation and stop strings against whole-text decoding."""

import pytest

from dpserve.frontend.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from dpserve.frontend.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_llama))


TEXTS = ["Hello world, how are you today?", "naïve café — ünïcödé ✓ 日本語 🙂 done",
         "def add(x, y):\n    return x + y\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("The quick brown fox")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    for i in ids:  # one token at a time, as a decode step delivers them
        detok.update([i])
        pieces.append(detok.delta_text(finished=False))
    pieces.append(detok.delta_text(finished=True))
    assert detok.output_text == tokenizer.decode(ids) == text
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("Hello world") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [1])
    detok.update(ids)
    assert detok.output_text == "Hello world"
    detok = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    detok.update(ids)
    assert detok.output_text.endswith(tokenizer.eos_token)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates(tokenizer, include):
    ids = tokenizer.encode("Hello world, how are you today?")
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["how", "xyz"],
                                   include_stop_str_in_output=include)
    hit = None
    for i in ids:
        hit = detok.update([i])
        if hit:
            break
    assert hit == "how"
    assert detok.output_text == ("Hello world, how" if include else "Hello world, ")


def test_streaming_holds_back_possible_stop_start(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["you today"])
    sent = ""
    for i in tokenizer.encode("Hello world, how are you"):
        assert detok.update([i]) is None
        sent += detok.delta_text(finished=False)
    # "you" might begin the stop string: it must not have been sent yet.
    assert not sent.endswith("you")
    assert "Hello world" in sent
    assert sent + detok.delta_text(finished=True) == "Hello world, how are you"
