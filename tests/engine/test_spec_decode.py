"""Speculative decoding as pure logic: the option, the n-gram proposer, verification
(greedy and the exactness of point-mass speculative sampling), and the scheduler
driven by hand-made model outputs (drafts as lookahead slots, rollback, stops inside
an accepted run, which requests get drafts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpserve.config import CacheConfig, ConfigError, EngineArgs, SchedulerConfig
from dpserve.engine.request import Request, RequestStatus
from dpserve.engine.scheduler import Scheduler
from dpserve.engine.spec_decode import StepCosts, choose_drafts, propose_ngram
from dpserve.engine_config import SpeculativeConfig
from dpserve.model.sampler import Sampler
from dpserve.model.spec_verify import accept_point_mass, verify
from dpserve.sampling_params import SamplingParams
from dpserve.step import ModelRunnerOutput, ScheduledRequest

BS = 4
EOS = 2


def spec_json(k: int = 4, high: int = 3, low: int = 1) -> str:
    return (f'{{"method": "ngram", "num_speculative_tokens": {k}, '
            f'"prompt_lookup_max": {high}, "prompt_lookup_min": {low}}}')


# ---- the option ---------------------------------------------------------------


def test_the_option_takes_vllms_json_and_defaults():
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(spec_json(5, 4, 2)) == SpeculativeConfig("ngram", 5, 4, 2)
    only_max = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    neither = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (neither.prompt_lookup_min, neither.prompt_lookup_max) == (5, 5)  # vLLM's
    assert neither.disable_by_batch_size is None  # drafts at any batch size, as vLLM
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "disable_by_batch_size": 4}).disable_by_batch_size == 4


@pytest.mark.parametrize("value, message", [
    ("{", "must be a JSON object"),
    ("[1]", "must be a JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram"),
    ('{"method": "ngram"}', "num_speculative_tokens must be an integer in [1, 16]"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "in [1, 16]"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "in [1, 16]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "1 <= prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
     "1 <= prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft": 1}', "unknown key(s) draft"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
     "disable_by_batch_size must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "4"}',
     "disable_by_batch_size must be a positive integer"),
])
def test_a_bad_option_is_one_line_naming_it(value, message):
    with pytest.raises(ConfigError) as e:
        EngineArgs(speculative_config=value).check_options()
    text = str(e.value)
    assert text.startswith("speculative_config") and message in text and "\n" not in text


# ---- the proposer ---------------------------------------------------------------


def ngram(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    return propose_ngram(np.array(tokens, dtype=np.int64), low, high, k).tolist()


def test_the_proposer_continues_the_longest_earliest_match():
    # The suffix [1, 2, 3] occurred at the start: what followed it comes, up to k.
    assert ngram([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 1, 3, 4) == [4, 5, 6, 7]
    assert ngram([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 1, 3, 2) == [4, 5]
    # The longest match wins over a later, shorter one: [9, 2] -> 5, not [2] -> 8.
    assert ngram([9, 2, 5, 6, 2, 8, 9, 2], 1, 3, 2) == [5, 6]
    # Of equally long matches (capped at prompt_lookup_max), the earliest.
    assert ngram([4, 7, 1, 4, 7, 3, 4, 7], 2, 2, 1) == [1]
    # Shorter than prompt_lookup_min: nothing; no earlier occurrence: nothing.
    assert ngram([5, 1, 2, 7, 1, 2], 3, 3, 4) == []
    assert ngram([5, 1, 2, 7, 1, 2], 2, 3, 4) == [7, 1, 2]
    assert ngram([1, 2, 3, 4], 1, 3, 4) == []
    # A run of one token proposes more of it (the match may overlap the suffix).
    assert ngram([9, 9, 9, 9], 1, 2, 4) == [9, 9]


# ---- verification ---------------------------------------------------------------


@pytest.mark.parametrize("draft", [0, 1, 2, 3, -1])
def test_point_mass_speculative_sampling_is_distributed_as_p(draft):
    """Accept d with probability p(d), else draw from p without d: the token's law is p
    itself, for a draft with p(d) = 0 (3), p(d) = 1 after renormalising nothing, and a
    bonus row (-1: no draft). Chi-square with 3 degrees of freedom, fixed seed."""
    p = torch.tensor([0.5, 0.2, 0.3, 0.0])
    draws = 200_000
    gen = torch.Generator().manual_seed(1234 + draft)
    accepted, tokens = accept_point_mass(p.repeat(draws, 1), torch.full((draws,), draft),
                                         torch.rand(draws, 2, generator=gen))
    counts = torch.bincount(tokens, minlength=4).double()
    assert counts[3] == 0  # never a token of probability 0
    expected = p.double()[:3] * draws
    chi2 = float((((counts[:3] - expected) ** 2) / expected).sum())
    assert chi2 < 16.3  # P(chi2_2 > 16.3) < 3e-4
    rate = float(accepted.double().mean())
    assert rate == pytest.approx(float(p[draft]) if draft >= 0 else 0.0, abs=0.005)


def test_a_certain_draft_is_always_accepted():
    p = torch.tensor([[0.0, 1.0, 0.0]]).repeat(1000, 1)
    accepted, tokens = accept_point_mass(p, torch.ones(1000, dtype=torch.int64),
                                         torch.rand(1000, 2))
    assert bool(accepted.all()) and bool((tokens == 1).all())


def scheduled(req_id: str, tokens: list[int], drafts: list[int], **params) -> ScheduledRequest:
    params.setdefault("temperature", 0.0)
    return ScheduledRequest(req_id, tokens, len(tokens), len(tokens) - 1, 1 + len(drafts),
                            [0], True, SamplingParams(**params), EOS,
                            spec_token_ids=list(drafts))


def one_hot_rows(argmaxes: list[int], vocab: int = 16) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_verification_keeps_the_prefix_the_argmax_agrees_with():
    sampler = Sampler(0, torch.device("cpu"))
    reqs = [scheduled("a", [1, 2], [5, 6, 7]), scheduled("b", [1, 2], [3, 4]),
            scheduled("c", [1], [9])]
    # a: 5 and 6 agree, 7 does not (argmax 8): [5, 6, 8]; b: all agree, bonus 11;
    # c: the first disagrees: the argmax alone.
    logits = one_hot_rows([5, 6, 8, 0, 3, 4, 11, 12, 13])
    runs = verify(sampler, logits, reqs, 16, torch.device("cpu"))
    assert runs == [[5, 6, 8], [3, 4, 11], [12]]


def test_sampled_verification_emits_the_samplers_distribution():
    """Through `verify`: temperature and top-k applied as the sampler does, the first
    token of each run is distributed as the processed p, whatever the draft (2 is the
    likeliest; 3 is cut by top-k)."""
    sampler = Sampler(7, torch.device("cpu"))
    base = torch.tensor([0.4, 0.1, 0.45, 0.05])
    temperature, n = 0.5, 20_000
    p = base ** (1 / temperature)
    p[3] = 0.0  # top_k=3 drops the least likely
    p /= p.sum()
    for draft in (2, 3):
        reqs = [scheduled(f"r{i}", [1, 2], [draft], temperature=temperature, top_k=3)
                for i in range(n)]
        logits = base.log().repeat(2 * n, 1)  # [draft row, bonus row] per request
        runs = verify(sampler, logits, reqs, 4, torch.device("cpu"))
        first = torch.bincount(torch.tensor([run[0] for run in runs]), minlength=4).double()
        assert first[3] == 0
        chi2 = float((((first[:3] - n * p[:3]) ** 2) / (n * p[:3])).sum())
        assert chi2 < 16.3, (draft, first / n, p)
        assert all(len(run) == 2 for run in runs if run[0] == draft)  # accepted: + bonus


def test_verification_applies_logit_bias_as_the_sampler_does():
    sampler = Sampler(0, torch.device("cpu"))
    req = scheduled("a", [1, 2], [5], logit_bias={9: 100.0})
    runs = verify(sampler, one_hot_rows([5, 6]), [req], 16, torch.device("cpu"))
    assert runs == [[9]]  # the bias makes 9 the argmax at every position: 5 rejected


# ---- the scheduler ----------------------------------------------------------------


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_model_len: int = 128,
                   k: int = 4, disable_by_batch_size: int | None = None) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                             max_model_len=max_model_len,
                             speculative=SpeculativeConfig("ngram", k, 3, 1,
                                                           disable_by_batch_size))
    return Scheduler(config, CacheConfig(block_size=BS, kv_cache_memory=None,
                                         gpu_memory_utilization=0.9,
                                         enable_prefix_caching=True,
                                         num_kv_blocks=num_blocks), num_blocks)


def make_request(req_id: str, prompt: list[int], **params) -> Request:
    params.setdefault("max_tokens", 32)
    params.setdefault("temperature", 0.0)
    return Request(req_id, prompt, SamplingParams(**params), eos_token_id=EOS)


REPEATING = [10, 11, 12, 13, 14, 15, 10, 11, 12]  # lookup proposes 13, 14, 15, 10


def output(out, produced: dict[str, list[int]], default: int = 12) -> ModelRunnerOutput:
    """The runner's rows: produced[req_id] (all of a speculative row's tokens), else
    `default` for a one-token row."""
    rows = [s for s in out.scheduled if s.sample]
    produced = {s.req_id: produced.get(s.req_id, [default]) for s in rows}
    return ModelRunnerOutput([s.req_id for s in rows],
                             [produced[s.req_id][0] for s in rows],
                             spec_token_ids={s.req_id: produced[s.req_id] for s in rows
                                             if s.spec_token_ids})


def prefill(sched: Scheduler, request: Request, first: int) -> None:
    sched.add_request(request)
    while not request.output_token_ids:  # (in chunks under a small budget)
        out = sched.schedule()
        sched.update_from_output(out, output(out, {request.request_id: [first]}))


def test_drafts_are_lookahead_slots_rolled_back_when_rejected():
    sched = make_scheduler()
    req = make_request("r", REPEATING[:-1])
    prefill(sched, req, 12)  # the prompt's next token: now [.., 10, 11, 12]
    out = sched.schedule()
    [s] = out.scheduled
    assert s.spec_token_ids == [13, 14, 15, 10] and s.num_new_tokens == 5
    assert s.tokens(s.start, s.start + 5) == [12, 13, 14, 15, 10]
    assert out.total_num_tokens == 5 and out.num_decodes == 1  # decode-shaped
    # Slots for all 5 positions (tokens 0..13: 4 blocks), but only blocks full of known
    # tokens are hashed (9 tokens: 2 blocks), and no count includes the drafts.
    assert len(s.block_ids) == 4 and len(sched.kv_cache.pool.cached) == 2
    assert req.num_computed_tokens == req.num_tokens == 9 and req.block_hashes[-1:]
    # Two drafts accepted, then the model's own token.
    sched.update_from_output(out, output(out, {"r": [13, 14, 99]}))
    assert req.output_token_ids == [12, 13, 14, 99]
    assert req.num_computed_tokens == 11 == req.num_tokens - 1  # 15 and 10: rolled back
    assert sched.spec.counters.num_draft_tokens == 4
    assert sched.spec.counters.num_accepted_tokens == 2
    # The next step computes from the first rejected position on.
    out = sched.schedule()
    assert out.scheduled[0].start == 11


def test_a_stop_inside_the_accepted_run_ends_the_request_there():
    sched = make_scheduler()
    req = make_request("r", REPEATING[:-1])
    prefill(sched, req, 12)
    out = sched.schedule()
    [delta] = sched.update_from_output(out, output(out, {"r": [13, EOS, 15]}))
    assert delta.new_token_ids == [13, EOS] and req.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv_cache.num_free_blocks == 64  # freed


def test_drafts_stop_short_of_max_tokens_and_of_the_budget():
    sched = make_scheduler(budget=3)
    req = make_request("r", REPEATING[:-1], max_tokens=4)
    prefill(sched, req, 12)
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == [13, 14]  # the budget: 1 + 2 tokens
    [delta] = sched.update_from_output(out, output(out, {"r": [13, 14, 15]}))
    assert delta.new_token_ids == [13, 14, 15] and delta.finish_reason is not None
    assert req.num_output_tokens == 4  # max_tokens


@pytest.mark.parametrize("params", [
    {"logprobs": 1}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2},
    {"temperature": 0.7, "seed": 3}, {"min_tokens": 8}])
def test_requests_the_verifier_cannot_serve_get_no_drafts(params):
    sched = make_scheduler()
    plain, other = make_request("plain", REPEATING[:-1]), make_request("other",
                                                                        REPEATING[:-1],
                                                                        **params)
    sched.add_request(plain)
    prefill(sched, other, 12)  # both prefilled in one step
    out = sched.schedule()
    by_id = {s.req_id: s for s in out.scheduled}
    assert by_id["plain"].spec_token_ids and not by_id["other"].spec_token_ids
    assert out.num_decodes == 2  # both decode-shaped: attended token by token


def test_a_moved_request_gets_drafts_from_its_tokens_alone():
    """A migrated (or handed-off) request arrives as prompt + prior outputs: its first
    decode here already gets proposals, nothing carried from its old rank."""
    sched = make_scheduler()
    moved = Request("m", REPEATING[:4], SamplingParams(temperature=0.0, max_tokens=32),
                    eos_token_id=EOS, prior_output_token_ids=REPEATING[4:-1])
    sched.add_request(moved)
    out = sched.schedule()  # prompt and prior outputs computed again here
    sched.update_from_output(out, output(out, {"m": [12]}))
    assert sched.schedule().scheduled[0].spec_token_ids == [13, 14, 15, 10]


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size():
    sched = make_scheduler(disable_by_batch_size=2)
    first, second = make_request("a", REPEATING[:-1]), make_request("b", REPEATING[:-1])
    sched.add_request(first)
    prefill(sched, second, 12)  # both prefilled in one step: two running
    out = sched.schedule()
    assert all(s.spec_token_ids == [13, 14, 15, 10] for s in out.scheduled)
    sched.update_from_output(out, output(out, {"a": [13], "b": [13]}))
    prefill(sched, make_request("c", [20, 21, 22]), 12)  # a third: past the limit
    out = sched.schedule()
    assert len(out.scheduled) == 3 and not any(s.spec_token_ids for s in out.scheduled)
    assert all(s.num_new_tokens == 1 for s in out.scheduled)


def test_step_costs_fit_a_fixed_and_a_per_row_cost():
    costs = StepCosts()
    for _ in range(20):
        costs.observe(16, 0.030 + 16 * 0.001)
    assert costs.fit() is None  # one size only: no slope to see
    for rows in (20, 40, 80, 17):
        costs.observe(rows, 0.030 + rows * 0.001)
    fixed, per_row = costs.fit()
    assert fixed == pytest.approx(0.030) and per_row == pytest.approx(0.001)


def test_drafts_are_kept_while_they_raise_the_steps_tokens_per_second():
    offers = [(0, 0.9, 4), (1, 0.2, 4)]  # (offer, acceptance rate, drafts proposed)
    assert choose_drafts(offers, 16, None) == {0: 4, 1: 4}  # no fit yet: every draft
    # Bound by reading the weights (a large fixed cost): nearly every draft pays (not
    # the unlikely request's third, worth 0.2^3 = 0.008 tokens, for 0.2% more time).
    assert choose_drafts(offers, 16, (0.050, 0.0001)) == {0: 4, 1: 2}
    # Bound by arithmetic (a row costs what the step's share per token does): only
    # the likely drafts, the first ones first.
    assert choose_drafts(offers, 16, (0.030, 0.001)) == {0: 4, 1: 0}
    assert choose_drafts(offers, 16, (0.001, 0.001)) == {0: 0, 1: 0}
    assert choose_drafts([(0, 0.5, 4)], 1, (0.014, 0.0003)) == {0: 4}  # one stream


def test_a_request_whose_drafts_fail_stops_drafting_on_a_costly_step():
    """With steps that cost by the row, the planner keeps the drafts of a request whose
    drafts were accepted and drops those of one whose drafts were rejected."""
    sched = make_scheduler()
    good, bad = make_request("good", REPEATING[:-1]), make_request("bad", REPEATING[:-1])
    sched.add_request(good)
    prefill(sched, bad, 12)
    for _ in range(3):  # no step costs known yet: every proposal is drafted
        out = sched.schedule()
        drafts = {s.req_id: s.spec_token_ids for s in out.scheduled}
        assert all(drafts.values())
        # good: every draft accepted, then the cycle's next token; bad: 10, where no
        # draft is 10 (its first is 13 or 11), and after a 10 lookup proposes again.
        following = REPEATING[REPEATING.index(drafts["good"][-1]) + 1]
        sched.update_from_output(out, output(out, {"good": drafts["good"] + [following],
                                                   "bad": [10]}))
    assert bad.draft_state.rate < 0.25 < 0.9 < good.draft_state.rate
    for rows in range(2, 12):  # decode steps cost 4 ms + 2 ms a row
        sched.spec.costs.observe(rows, 0.004 + 0.002 * rows)
    out = sched.schedule()
    by_id = {s.req_id: s for s in out.scheduled}
    assert by_id["good"].spec_token_ids and not by_id["bad"].spec_token_ids


def test_a_newcomer_probes_with_one_draft_where_the_engines_drafts_fail():
    """A new request starts from the engine's acceptance rate; where that is too low
    for drafts to pay it still verifies one, and goes on by its own rate."""
    sched = make_scheduler()
    bad = make_request("bad", REPEATING[:-1])
    prefill(sched, bad, 12)
    for _ in range(3):  # no step costs known yet: drafted, and rejected (10 is no draft)
        out = sched.schedule()
        assert out.scheduled[0].spec_token_ids
        sched.update_from_output(out, output(out, {"bad": [10]}))
    for rows in range(2, 12):  # decode steps cost 4 ms + 2 ms a row
        sched.spec.costs.observe(rows, 0.004 + 0.002 * rows)
    new = make_request("new", REPEATING[:-1])
    prefill(sched, new, 12)
    out = sched.schedule()
    by_id = {s.req_id: s for s in out.scheduled}
    assert new.draft_state.rate < 0.25  # the engine's: worth no draft at these costs
    assert len(by_id["new"].spec_token_ids) == 1 and not by_id["bad"].spec_token_ids
    sched.update_from_output(out, output(out, {"new": [10], "bad": [10]}))  # rejected
    out = sched.schedule()
    assert not any(s.spec_token_ids for s in out.scheduled)


def test_without_room_for_drafts_a_request_decodes_without_them():
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    req, other = make_request("r", REPEATING[:-1]), make_request("o", [20, 21, 22])
    sched.add_request(req)
    prefill(sched, other, 12)  # r: 2 blocks, o: 1 block; one left
    out = sched.schedule()
    # r's token and 4 drafts would need 2 more blocks: it decodes one token, nobody
    # is preempted for its drafts.
    assert out.scheduled[0].req_id == "r" and out.scheduled[0].spec_token_ids == []
    assert out.scheduled[0].num_new_tokens == 1 and not out.preempted_req_ids


def test_a_stop_string_inside_a_multi_token_delta_cuts_the_tokens_too(tiny_llama):
    """A speculative engine sends an accepted run in one delta: a stop string completed
    by one of its tokens ends text and token ids there, as one token at a time would."""
    from dpserve.frontend.output_processor import OutputProcessor
    from dpserve.frontend.tokenizer import load_tokenizer
    from dpserve.protocol import EngineCoreOutput

    tok = load_tokenizer(str(tiny_llama))
    ids = tok.encode("Hello world, how are you today?")
    cut = next(n for n in range(1, len(ids)) if "world" in tok.decode(ids[:n]))
    assert cut < len(ids) - 1  # the stop string ends before the delta does
    proc = OutputProcessor(tok)
    [engine_request] = proc.add_request("r", None, [1, 2, 3],
                                        SamplingParams(max_tokens=32, stop=["world"]))
    result = proc.process_outputs([EngineCoreOutput(engine_request.request_id, ids)])
    [out] = result.request_outputs
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == ids[:cut]
    assert out.outputs[0].text == tok.decode(ids[:cut]).split("world")[0]
    assert result.reqs_to_abort == [engine_request.request_id]  # the engine is told to stop


# ---- randomised walk: KV read at every position is what the tokens say ------------


class SpecDriver:
    """A scheduler with speculation on a small pool and a two-token alphabet (drafts
    come often), stepped with a stand-in runner that accepts a random prefix of each
    row's drafts. Each KV slot records the token prefix it was computed from; every
    step checks each request reads the right prefix at every position it attends to
    (prefix-cache hits included), so a rejected draft's KV counted as computed, or a
    block holding one registered in the prefix cache, fails it."""

    def __init__(self, rng, num_blocks: int, budget: int) -> None:
        self.rng = rng
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4,
                                 max_model_len=24,
                                 speculative=SpeculativeConfig("ngram", 3, 2, 1))
        self.sched = Scheduler(config, CacheConfig(
            block_size=BS, kv_cache_memory=None, gpu_memory_utilization=0.9,
            enable_prefix_caching=True, num_kv_blocks=num_blocks), num_blocks)
        self.requests: dict[str, Request] = {}
        self.seen: dict[str, list[int]] = {}
        self.kv: dict[int, list] = {}  # block_id -> the prefix each slot came from

    def add(self) -> None:
        req_id = f"r{len(self.requests)}"
        prompt = [self.rng.randint(0, 1) for _ in range(self.rng.randint(1, 10))]
        self.requests[req_id] = Request(req_id, prompt, SamplingParams(
            temperature=0.0, max_tokens=self.rng.randint(1, 12)), eos_token_id=3)
        self.seen[req_id] = []
        self.sched.add_request(self.requests[req_id])

    def step(self) -> None:
        out = self.sched.schedule()
        assert out.total_num_tokens <= self.sched.config.max_num_batched_tokens
        self.forward(out)
        produced = {}
        for s in out.scheduled:
            if s.sample:
                accepted = self.rng.randint(0, len(s.spec_token_ids))
                produced[s.req_id] = [*s.spec_token_ids[:accepted], self.rng.randint(0, 3)]
        rows = [s for s in out.scheduled if s.sample]
        for delta in self.sched.update_from_output(out, ModelRunnerOutput(
                [s.req_id for s in rows], [produced[s.req_id][0] for s in rows],
                spec_token_ids={s.req_id: produced[s.req_id] for s in rows
                                if s.spec_token_ids})):
            self.seen[delta.request_id] += delta.new_token_ids

    def forward(self, out) -> None:
        for s in out.scheduled:  # every write first, as the runner's layers do
            for pos in range(s.start, s.start + s.num_new_tokens):
                block = self.kv.setdefault(s.block_ids[pos // BS], [None] * BS)
                block[pos % BS] = tuple(s.tokens(0, pos + 1))
        for s in out.scheduled:
            for pos in range(s.start + s.num_new_tokens):
                assert self.kv[s.block_ids[pos // BS]][pos % BS] == tuple(s.tokens(0, pos + 1)), (
                    f"{s.req_id} reads stale KV at position {pos}")


@pytest.mark.parametrize("first_seed", range(0, 400, 100))
def test_random_walks_with_drafts_read_the_right_kv_and_drain_clean(first_seed):
    import random

    drafted = 0
    for seed in range(first_seed, first_seed + 100):
        rng = random.Random(seed)
        driver = SpecDriver(rng, num_blocks=rng.randint(6, 14), budget=rng.randint(2, 12))
        for _ in range(30):
            if rng.random() < 0.3:
                driver.add()
            elif driver.sched.has_unfinished_requests():
                driver.step()
        for _ in range(5_000):
            if not driver.sched.has_unfinished_requests():
                break
            driver.step()
        sched = driver.sched
        assert not sched.requests
        assert sched.kv_cache.num_free_blocks == sched.kv_cache.pool.num_blocks
        for req_id, request in driver.requests.items():
            assert driver.seen[req_id] == request.output_token_ids
        drafted += sched.spec.counters.num_draft_tokens
    assert drafted > 0  # speculation happened
