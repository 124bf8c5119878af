"""`dpserve.prompt.check_prompt`: the one prompt rule of the engine and the front-end."""

from __future__ import annotations

import pytest

from dpserve.prompt import PromptError, check_prompt


def test_a_prompt_that_fits_passes():
    check_prompt([1, 2, 3], max_model_len=8, vocab_size=10, max_tokens=5)
    check_prompt([1, 2, 3], max_model_len=8, vocab_size=10, prior_token_ids=[4, 5, 6, 7])


@pytest.mark.parametrize("ids, message", [
    ([], "the prompt must not be empty"),
    ([1, 10], r"prompt token id 10 is outside the vocabulary \[0, 10\)"),
    ([1, -1], r"prompt token id -1 is outside the vocabulary \[0, 10\)"),
])
def test_bad_prompts_name_the_prompt(ids, message):
    with pytest.raises(PromptError, match=message) as e:
        check_prompt(ids, max_model_len=8, vocab_size=10)
    assert e.value.param == "prompt" and isinstance(e.value, ValueError)


def test_the_engines_rule_prompt_plus_prior_must_leave_one_token():
    check_prompt([1] * 7, max_model_len=8, vocab_size=10)
    with pytest.raises(PromptError, match=r"maximum context length is 8 tokens.*requested 9 "
                       r"tokens \(8 in the prompt, 1 for the completion\)") as e:
        check_prompt([1] * 8, max_model_len=8, vocab_size=10)
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(PromptError, match=r"\(5 in the prompt, 3 generated before, 1 for"):
        check_prompt([1] * 5, max_model_len=8, vocab_size=10, prior_token_ids=[2, 3, 4])
    with pytest.raises(PromptError, match="prompt token id 12"):
        check_prompt([1], max_model_len=8, vocab_size=10, prior_token_ids=[12])


def test_the_front_ends_budget_blames_max_tokens_when_the_prompt_fits():
    with pytest.raises(PromptError, match=r"requested 9 tokens \(4 in the prompt, 5 for the "
                       r"completion\)") as e:
        check_prompt([1] * 4, max_model_len=8, vocab_size=10, max_tokens=5)
    assert e.value.param == "max_tokens"
