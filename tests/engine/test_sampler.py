"""Sampler tests on crafted logits: filters, seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from dpserve.engine.request import Request
from dpserve.model.sampler import (
    Sampler,
    SamplingMetadata,
    make_generator,
    top_k_top_p_threshold,
)
from dpserve.sampling_params import SamplingParams
from dpserve.step import ScheduledRequest

CPU = torch.device("cpu")


def request(i: int, prompt: list[int] | None = None, output: list[int] = (),
            eos: int | None = None, **params) -> ScheduledRequest:
    """The sampler's view of a request whose step samples its next token."""
    req = Request(f"r{i}", prompt or [0], SamplingParams(**params), eos_token_id=eos)
    for t in output:
        req.append_output_token(t)
    return req.for_step(0, req.num_tokens, [0], sample=True)


def sample(logits: torch.Tensor, reqs: list[ScheduledRequest], sampler: Sampler | None = None,
           generators: dict[str, torch.Generator] | None = None):
    generators = {} if generators is None else generators
    for r in reqs:
        if r.sampling_params.seed is not None and r.req_id not in generators:
            generators[r.req_id] = make_generator(r.sampling_params.seed, CPU)
    meta = SamplingMetadata.from_requests(reqs, generators, logits.shape[1], CPU)
    return (sampler or Sampler(0, CPU))(logits.clone(), meta)


def probs_logits(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


def test_greedy_is_argmax():
    logits = torch.randn(8, 50)
    tokens, lp = sample(logits, [request(i, temperature=0.0) for i in range(8)])
    assert torch.equal(tokens, logits.argmax(-1))
    assert lp is None


def test_top_k_1_equals_greedy():
    logits = torch.randn(16, 100) * 3
    tokens, _ = sample(logits, [request(i, temperature=1.0, top_k=1) for i in range(16)])
    assert torch.equal(tokens, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(6, 40)
    reqs = [request(i, temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    tokens, _ = sample(logits, reqs)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))


def test_top_p_never_picks_filtered_tokens():
    # mass 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps exactly the first two
    logits = probs_logits([0.5, 0.3, 0.15, 0.05], 2000)
    tokens, _ = sample(logits, [request(i, top_p=0.7) for i in range(2000)])
    assert set(tokens.tolist()) == {0, 1}


def test_min_p_never_picks_filtered_tokens():
    # min_p=0.2 -> floor 0.1: token 3 (0.05) is out
    logits = probs_logits([0.5, 0.3, 0.15, 0.05], 2000)
    tokens, _ = sample(logits, [request(i, min_p=0.2) for i in range(2000)])
    assert set(tokens.tolist()) == {0, 1, 2}


def test_top_k_never_picks_filtered_tokens():
    logits = torch.randn(500, 30)
    reqs = [request(i, top_k=3) for i in range(500)]
    tokens, _ = sample(logits, reqs)
    top3 = logits.topk(3, dim=-1).indices
    assert bool((top3 == tokens[:, None]).any(-1).all())


def reference_threshold(logits: torch.Tensor, k: int, p: float) -> float:
    """Straightforward full-sort top-k then top-p; -inf when nothing is filtered."""
    vocab = logits.shape[0]
    if k >= vocab and p >= 1.0:
        return -math.inf
    vals = logits.sort(descending=True).values[:min(k, vocab)]
    if p >= 1.0:
        return float(vals[-1])
    probs = torch.softmax(vals, dim=-1)
    cum = probs.cumsum(0)
    n = int((cum < p).sum()) + 1
    return float(vals[min(n, len(vals)) - 1])


def test_top_k_top_p_threshold_matches_full_sort():
    torch.manual_seed(0)
    vocab = 1000
    rows = 24
    # mix of peaked and flat rows; flat rows with top_p need the full-sort fallback
    scale = torch.tensor([0.1, 5.0, 1.0, 0.01] * (rows // 4))[:, None]
    logits = torch.randn(rows, vocab) * scale
    ks = torch.tensor([vocab, 5, vocab, 300, vocab, vocab] * (rows // 6))
    ps = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.3, 1.0, 0.8, 0.99] * (rows // 8))
    got = top_k_top_p_threshold(logits, ks, ps)
    for r in range(rows):
        want = reference_threshold(logits[r], int(ks[r]), float(ps[r]))
        assert math.isclose(float(got[r]), want, rel_tol=1e-6) or float(got[r]) == want, r


def test_seeded_rows_same_alone_and_in_any_batch():
    logits = torch.randn(1, 200) * 0.5  # fairly flat: many possible tokens

    def run(batch_builder, steps=8):
        gens: dict[str, torch.Generator] = {}
        sampler = Sampler(123, CPU)
        out = []
        for _ in range(steps):
            reqs, row = batch_builder()
            rows = torch.cat([logits] * len(reqs))
            tokens, _ = sample(rows, reqs, sampler, gens)
            out.append(int(tokens[row]))
        return out

    target = request(0, seed=42)
    alone = run(lambda: ([target], 0))
    with_others = run(lambda: ([request(1), request(2, seed=7), target,
                                request(3, temperature=0.0), request(4, top_p=0.9)], 2))
    other_order = run(lambda: ([target, request(5, seed=1)], 0))
    assert alone == with_others == other_order
    other_seed = run(lambda: ([request(0, seed=43)], 0))
    assert other_seed != alone


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.zeros(4, 1000)
    a, _ = sample(logits, [request(i) for i in range(4)], Sampler(5, CPU))
    b, _ = sample(logits, [request(i) for i in range(4)], Sampler(5, CPU))
    c, _ = sample(logits, [request(i) for i in range(4)], Sampler(6, CPU))
    assert torch.equal(a, b) and not torch.equal(a, c)


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int],
                        presence: float, frequency: float, repetition: float) -> torch.Tensor:
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def test_penalties_match_reference():
    torch.manual_seed(1)
    logits = torch.randn(3, 10) * 2
    cases = [([1, 2, 3], [3, 3, 4, 9], 0.5, 0.3, 1.5),
             ([0], [], 1.0, 1.0, 1.0),  # no penalty on this row
             ([5, 5, 6], [6, 7], -0.4, 0.0, 0.7)]
    reqs = [request(i, prompt=p, output=o, temperature=0.0, presence_penalty=pp,
                    frequency_penalty=fp, repetition_penalty=rp)
            for i, (p, o, pp, fp, rp) in enumerate(cases)]
    meta = SamplingMetadata.from_requests(reqs, {}, 10, CPU)
    from dpserve.model.sampler import apply_penalties

    got = logits.clone()
    apply_penalties(got, meta.penalties)
    for r, (p, o, pp, fp, rp) in enumerate(cases):
        torch.testing.assert_close(got[r], reference_penalties(logits[r], p, o, pp, fp, rp))


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(3, 10)
    logits[:, 7] = 10.0  # EOS is the clear favourite
    logits[:, 8] = 9.0  # then a stop id
    reqs = [request(0, eos=7, min_tokens=2, stop_token_ids=[8], temperature=0.0, output=[1]),
            request(1, eos=7, min_tokens=2, stop_token_ids=[8], temperature=0.0, output=[1, 2]),
            request(2, eos=7, min_tokens=3, ignore_eos=True, temperature=0.0)]
    tokens, _ = sample(logits, reqs)
    assert tokens[0] not in (7, 8)  # still short: both masked
    assert tokens[1] == 7  # long enough
    assert tokens[2] == 7  # ignore_eos: EOS is not a stop, not masked


def test_logprobs_of_sampled_and_top_n():
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    reqs = [request(0, logprobs=3), request(1, temperature=0.0, logprobs=0),
            request(2, logprobs=5), request(3)]
    tokens, lp = sample(logits, reqs)
    assert lp is not None
    ref = torch.log_softmax(logits, dim=-1)
    assert lp.token_ids.shape == lp.logprobs.shape == (4, 6)  # sampled + max N = 5
    assert torch.equal(lp.token_ids[:, 0], tokens)
    torch.testing.assert_close(lp.logprobs[:, 0], ref.gather(1, tokens[:, None])[:, 0])
    for r in range(4):
        rank = int((ref[r] > ref[r, tokens[r]]).sum()) + 1
        assert int(lp.sampled_ranks[r]) == rank
        top = ref[r].topk(5)
        assert lp.token_ids[r, 1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(lp.logprobs[r, 1:], top.values)
        assert bool((lp.logprobs[r, 1:].diff() <= 0).all())
    assert int(lp.sampled_ranks[1]) == 1  # greedy row: its token is the best


def test_logprobs_come_from_raw_logits():
    logits = torch.randn(1, 20)
    (tok,), lp = sample(logits, [request(0, temperature=0.5, repetition_penalty=1.8,
                                         prompt=list(range(10)), logprobs=2)])
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(lp.logprobs[0, 0], raw[0, tok])


@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_sampling_follows_the_distribution(temperature):
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log().expand(20000, -1).contiguous()
    tokens, _ = sample(logits, [request(i, temperature=temperature) for i in range(20000)])
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    want = torch.softmax(probs.log() / temperature, dim=0)
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)
