"""Speculative decoding on the host: n-gram proposals, and the scheduler's K + 1 query tokens, pages and updates
(against the fake device of tests/fakes.py, whose verification is greedy). No jax."""

from __future__ import annotations

import random

import pytest

from fakes import FakeDevice, next_token, reference_continuation
from jaxserve.kv.allocator import PageAllocator
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import Scheduler, SchedulerConfig
from jaxserve.spec.ngram import NgramProposer


def lookup(tokens, k, n_min, n_max):
    """The n-gram rule written plainly: the most recent earlier occurrence of the longest suffix that has one."""
    length = len(tokens)
    for n in range(min(n_max, length), n_min - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == tokens[length - n:]:
                return tuple(tokens[end:end + k])
    return ()


class _Seq:
    def __init__(self, tokens):
        self.token_ids = tokens


@pytest.mark.parametrize("n_min,n_max", [(1, 4), (2, 3), (3, 3)])
def test_ngram_proposals_match_the_plain_rule_as_the_sequence_grows(n_min, n_max):
    rng = random.Random(n_min * 10 + n_max)
    proposer = NgramProposer(n_min, n_max)
    seqs = [_Seq([rng.randint(0, 4) for _ in range(rng.randint(1, 12))]) for _ in range(5)]
    for _ in range(60):
        seq = rng.choice(seqs)
        seq.token_ids.extend(rng.randint(0, 4) for _ in range(rng.randint(1, 4)))  # accepted runs of 1..K+1
        k = rng.randint(1, 6)
        assert proposer.propose(seq, k) == lookup(seq.token_ids, k, n_min, n_max)


def test_ngram_examples():
    proposer = NgramProposer(1, 3)
    assert proposer.propose(_Seq([1, 2, 3, 9, 9, 1, 2, 3]), 3) == (9, 9, 1)  # the longest suffix, 3 tokens
    assert proposer.propose(_Seq([5, 6, 5, 6, 5]), 4) == (6, 5)  # overlapping the suffix, as far as known
    assert proposer.propose(_Seq([1, 2, 3]), 2) == ()  # nothing repeats


class OracleProposer:
    """Proposes the fake model's continuation, spoiled at a random position (or not at all)."""

    def __init__(self, seed: int, spoil: float = 0.4):
        self.rng, self.spoil = random.Random(seed), spoil

    def propose(self, seq, k):
        tokens = list(seq.token_ids)
        out = []
        for _ in range(k):
            token = next_token(tokens)
            if self.rng.random() < self.spoil:
                token = (token + 1) % 97
            out.append(token)
            tokens.append(token)
        return tuple(out)


def make(k=3, num_pages=64, page_size=4, max_num_seqs=8, budget=32, max_model_len=128, prefix_caching=True,
         proposer=None, disable=None):
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, page_size, k, disable)
    sched = Scheduler(config, PageAllocator(num_pages, page_size, prefix_caching), eos_token_ids=(),
                      proposer=proposer or OracleProposer(0))
    return sched, FakeDevice(num_pages, page_size, config.num_slots)


def engine_step(sched, dev, in_flight):
    """One EngineCore.step with async scheduling: one step ahead unless the scheduler speculates."""
    one_ahead = not sched.speculating
    if in_flight and not one_ahead:
        sched.update(*in_flight.pop())
    plan = sched.schedule()
    pending = (plan, dev.execute(plan)) if not plan.is_empty else None
    if one_ahead:
        previous = in_flight.pop() if in_flight else None
        if pending:
            in_flight.append(pending)
    else:
        previous = pending
    if previous:
        sched.update(*previous)
    sched.check_invariants()
    return plan


def run(sched, dev, on_plan=None, in_flight=None):
    in_flight = [] if in_flight is None else in_flight
    for _ in range(5000):
        if not (sched.has_work or in_flight):
            return
        plan = engine_step(sched, dev, in_flight)
        if on_plan:
            on_plan(plan)
    raise AssertionError("no progress")


def test_a_verify_step_runs_k_plus_one_tokens_and_advances_by_accepted_plus_one():
    sched, dev = make(k=3, proposer=OracleProposer(0, spoil=0.0))
    [seq] = sched.add_request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=20))
    engine_step(sched, dev, [])  # the prompt
    plan = engine_step(sched, dev, [])
    [row] = plan.seqs
    assert (row.num_new_tokens, row.context_len, row.num_draft_tokens) == (4, 9, 3)  # positions 5..8
    assert plan.is_verify and row.pages == (1, 2, 3)
    assert seq.num_computed_tokens == 9 and len(seq.token_ids) == 10  # 3 accepted + 1: the next token uncomputed
    assert seq.output_token_ids == reference_continuation([5, 6, 7, 8, 9], 5)
    assert (sched.speculation.num_drafts, sched.speculation.num_accepted_tokens) == (1, 3)


def test_rejected_proposals_give_their_pages_back():
    sched, dev = make(k=8, page_size=2, proposer=OracleProposer(0, spoil=1.0))  # always wrong
    [seq] = sched.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
    engine_step(sched, dev, [])
    plan = engine_step(sched, dev, [])
    assert len(plan.seqs[0].pages) == 6  # positions 3..11 were written
    assert len(seq.token_ids) == 5 and seq.num_computed_tokens == 4 and len(seq.pages) == 3
    assert sched.allocator.num_used_pages == 3
    assert sched.speculation.accepted_per_position == [0] * 8


def test_proposals_never_exceed_max_tokens_or_the_budget():
    sched, dev = make(k=5, budget=4, proposer=OracleProposer(0, spoil=0.0))
    [seq] = sched.add_request("a", [1, 2], SamplingParams(temperature=0.0, max_tokens=7))
    sizes = []
    run(sched, dev, lambda plan: sizes.append([r.num_draft_tokens for r in plan.seqs]))
    assert seq.output_token_ids == reference_continuation([1, 2], 7) and seq.finish_reason == "length"
    assert sizes[1:] == [[3], [1]]  # the budget leaves 3 proposals; then 2 tokens remain: 1 proposal
    assert sched.allocator.num_used_pages == 0


def test_speculation_stops_above_the_disable_batch_size():
    sched, dev = make(k=2, disable=2)
    for i in range(4):
        sched.add_request(f"r{i}", [i + 1, 7, 7], SamplingParams(temperature=0.0, max_tokens=4 + 4 * i))
    verify_batches = []
    run(sched, dev, lambda plan: verify_batches.append(len(plan.seqs)) if plan.is_verify else None)
    assert verify_batches and max(verify_batches) <= 2  # with more than 2 running, plain decoding


def test_stop_tokens_inside_an_accepted_run_end_the_sequence_there():
    prompt = [3, 1, 4]
    expected = reference_continuation(prompt, 12)
    sched, dev = make(k=4, proposer=OracleProposer(0, spoil=0.0))
    seq = sched.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                         stop_token_ids=(expected[6],)))[0]
    run(sched, dev)
    assert seq.output_token_ids == expected[:expected.index(expected[6]) + 1] and seq.finish_reason == "stop"


def random_traffic(sched, dev, rng, make_prompt, arrivals: float, aborts: float) -> dict:
    """400 engine steps with random arrivals (n = 1 or 2, greedy) and aborts, then to the end; returns the
    requests that were not aborted: id -> (prompt, sequences)."""
    expected, live, in_flight = {}, [], []
    for step in range(400):
        if rng.random() < arrivals and step < 300:
            rid = f"r{step}"
            prompt = make_prompt()
            params = SamplingParams(n=rng.choice([1, 1, 2]), temperature=0.0, max_tokens=rng.randint(1, 20))
            expected[rid] = (prompt, sched.add_request(rid, prompt, params))
            live.append(rid)
        if live and rng.random() < aborts:
            rid = live.pop(rng.randrange(len(live)))
            sched.abort_request(rid)
            expected.pop(rid)
        engine_step(sched, dev, in_flight)
    run(sched, dev, in_flight=in_flight)
    return expected


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_speculation_preemption_and_aborts(seed):
    rng = random.Random(seed)
    sched, dev = make(k=rng.choice([1, 3, 5]), num_pages=24, page_size=4, max_num_seqs=6, budget=24,
                      max_model_len=64, proposer=OracleProposer(seed), disable=rng.choice([None, 3]))
    expected = random_traffic(sched, dev, rng, lambda: [rng.randint(1, 5) for _ in range(rng.randint(1, 30))],
                              arrivals=0.3, aborts=0.05)
    assert sched.allocator.num_used_pages == 0 and sched.num_preemptions > 0
    assert sched.speculation.num_accepted_tokens > 0
    for prompt, seqs in expected.values():
        for s in seqs:
            assert s.finish_reason == "length"
            assert s.output_token_ids == reference_continuation(prompt, s.params.max_tokens)


# ---- a draft model's cache (jaxserve.spec.draft): its forward pass runs only in speculating steps ---------------
class DraftOracle(OracleProposer):
    keeps_cache = True  # as jaxserve.spec.draft.DeviceProposals: proposing needs the draft's own cache


class DraftFakeDevice(FakeDevice):
    """Also keeps the draft's cache, written only in steps with the draft's pass; a row that proposes must find
    every token before its query tokens there (what the draft model attends to)."""

    def __init__(self, num_pages, page_size, num_slots):
        super().__init__(num_pages, page_size, num_slots)
        self.draft_kv = [[None] * page_size for _ in range(num_pages)]
        self.proposing_rows = 0

    def execute(self, plan):
        for assignment in plan.new_slots:
            self.buffers[assignment.slot] = list(assignment.token_ids)
        for row in plan.seqs:
            first = row.context_len - row.num_new_tokens
            buffer = self.buffers[row.slot]
            if row.draft_token_ids:
                self.proposing_rows += 1
                assert plan.draft_pass
                attended = [self.draft_kv[row.pages[p // self.page_size]][p % self.page_size] for p in range(first)]
                assert attended == buffer[:first], "the draft's cache misses tokens of a sequence that proposes"
            if plan.draft_pass:
                known = row.context_len - row.num_draft_tokens
                tokens = buffer[:known] + list(row.draft_token_ids)
                for pos in range(first, row.context_len):
                    self.draft_kv[row.pages[pos // self.page_size]][pos % self.page_size] = tokens[pos]
        return super().execute(plan)


@pytest.mark.parametrize("seed", range(4))
def test_a_draft_proposes_only_over_a_whole_cache_of_its_own(seed):
    """Random traffic around the disable batch size (so steps with and without the draft's pass alternate), with
    shared prefixes, forks, preemption and aborts: every proposing row finds its tokens in the draft's cache,
    outputs stay exact, and speculation still happens."""
    rng = random.Random(seed)
    config = SchedulerConfig(6, 24, 64, 4, rng.choice([1, 3]), 3)
    sched = Scheduler(config, PageAllocator(28, 4, True), eos_token_ids=(), proposer=DraftOracle(seed, spoil=0.3))
    dev = DraftFakeDevice(28, 4, config.num_slots)
    shared = [rng.randint(1, 5) for _ in range(12)]
    expected = random_traffic(sched, dev, rng, lambda: shared[:rng.randint(0, 12)] + [
        rng.randint(1, 5) for _ in range(rng.randint(1, 16))], arrivals=0.25, aborts=0.04)
    assert sched.allocator.num_used_pages == 0
    assert dev.proposing_rows > 0 and sched.speculation.num_accepted_tokens > 0
    for prompt, seqs in expected.values():
        for s in seqs:
            assert s.output_token_ids == reference_continuation(prompt, s.params.max_tokens)


def test_a_step_without_the_drafts_pass_makes_its_sequences_stale():
    sched = Scheduler(SchedulerConfig(4, 64, 64, 4, 2, 1), PageAllocator(32, 4, True), eos_token_ids=(),
                      proposer=DraftOracle(0, spoil=0.0))
    dev = DraftFakeDevice(32, 4, sched.config.num_slots)
    a = sched.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=8))[0]
    b = sched.add_request("b", [6, 7, 8], SamplingParams(temperature=0.0, max_tokens=8))[0]
    plan = sched.schedule()  # nothing running yet: a speculating step, both admitted with the draft's pass
    assert plan.draft_pass and not a.draft_stale and not b.draft_stale
    sched.update(plan, dev.execute(plan))
    plan = sched.schedule()  # two running, over the limit of 1: no draft pass, no proposals
    assert not plan.draft_pass and not plan.is_verify and a.draft_stale and b.draft_stale
    sched.update(plan, dev.execute(plan))
    sched.abort_request("b")
    plan = sched.schedule()  # a alone: a speculating step again, but a's draft cache has a gap
    assert plan.draft_pass and not plan.is_verify
    sched.update(plan, dev.execute(plan))
    c = sched.add_request("c", [9, 9, 9], SamplingParams(temperature=0.0, max_tokens=8))[0]
    plan = sched.schedule()  # c starts whole
    assert not c.draft_stale
