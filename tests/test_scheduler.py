"""Scheduler: exact pages and order, chunked prefill, preemption, prefix sharing, n > 1, aborts, one step ahead."""

import ast
import dataclasses
import pathlib
import random

import pytest

from fakes import FakeDevice, reference_continuation, run_to_completion
from jaxserve.kv.allocator import PageAllocator
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import SampledToken, Scheduler, SchedulerConfig
from jaxserve.structured import StructuredOutputsParams


def make(num_pages=64, page_size=4, max_num_seqs=8, budget=32, max_model_len=128, prefix_caching=True):
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, page_size)
    sched = Scheduler(config, PageAllocator(num_pages, page_size, prefix_caching), eos_token_ids=())
    return sched, FakeDevice(num_pages, page_size, config.num_slots)


def greedy(n_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n_tokens, **kw)


def outputs(seqs):
    return [s.output_token_ids for s in seqs]


def test_single_request_pages_and_steps():
    sched, dev = make()
    [seq] = sched.add_request("a", [5, 6, 7, 8, 9], greedy(6))
    plan = sched.schedule()
    assert [(r.seq_id, r.num_new_tokens, r.context_len, r.sample, r.pages) for r in plan.seqs] == [
        (0, 5, 5, True, (1, 2))]
    assert plan.new_slots[0].slot == 1 and plan.new_slots[0].token_ids == (5, 6, 7, 8, 9)
    sched.update(plan, dev.execute(plan))
    plan = sched.schedule()
    assert plan.is_decode and plan.seqs[0].context_len == 6 and plan.seqs[0].pages == (1, 2)
    sched.update(plan, dev.execute(plan))
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, dev.execute(plan))
    assert plan.seqs[0].pages == (1, 2, 3)  # position 8 opened the third page
    plan = sched.schedule()
    sched.update(plan, dev.execute(plan))
    assert sched.schedule().is_empty
    assert seq.is_finished and seq.finish_reason == "length"
    assert seq.output_token_ids == reference_continuation([5, 6, 7, 8, 9], 6)
    assert sched.allocator.num_used_pages == 0
    sched.check_invariants()


def test_chunked_prefill_never_stalls_running_decodes():
    sched, dev = make(budget=8)
    sched.add_request("short", [1, 2], greedy(20))
    plan = sched.schedule()
    sched.update(plan, dev.execute(plan))
    sched.add_request("long", list(range(3, 23)), greedy(2))  # 20 prompt tokens
    sizes = []
    for _ in range(3):
        plan = sched.schedule()
        sizes.append([(r.seq_id, r.num_new_tokens) for r in plan.seqs])
        sched.update(plan, dev.execute(plan))
    assert sizes == [[(0, 1), (1, 7)], [(0, 1), (1, 7)], [(0, 1), (1, 6)]]


def test_budget_and_max_num_seqs_are_respected():
    sched, dev = make(max_num_seqs=3, budget=10)
    seqs = [sched.add_request(f"r{i}", [i + 1] * 6, greedy(3))[0] for i in range(5)]

    def check(plan):
        assert plan.num_tokens <= 10 and len(plan.seqs) <= 3
        assert len(sched.running) <= 3

    run_to_completion(sched, dev, on_step=check)
    assert outputs(seqs) == [reference_continuation([i + 1] * 6, 3) for i in range(5)]


@pytest.mark.parametrize("lag", [0, 1])
def test_preemption_recomputes_and_gives_the_same_tokens(lag):
    prompts = [[i + 1] * 7 for i in range(4)]
    # 9 usable pages of 4 tokens: not enough for four 7 + 12 token sequences at once
    sched, dev = make(num_pages=10, page_size=4, budget=64, prefix_caching=False)
    seqs = [sched.add_request(f"r{i}", p, greedy(12))[0] for i, p in enumerate(prompts)]
    run_to_completion(sched, dev, lag=lag)
    assert sched.num_preemptions > 0
    assert outputs(seqs) == [reference_continuation(p, 12) for p in prompts]
    assert sched.allocator.num_used_pages == 0


def test_preemption_picks_the_newest_request_first():
    sched, dev = make(num_pages=6, page_size=2, budget=64, prefix_caching=False)
    old = sched.add_request("old", [1, 2, 3, 4], greedy(4))[0]
    new = sched.add_request("new", [5, 6, 7, 8], greedy(4))[0]
    plan = sched.schedule()  # both admitted: 2 + 2 pages of the 5 usable
    sched.update(plan, dev.execute(plan))
    plan = sched.schedule()  # both need a third page; one is free
    assert [r.seq_id for r in plan.seqs] == [old.seq_id]
    assert new.num_preemptions == 1 and new.pages == [] and new in sched.waiting


def test_prefix_cache_shares_pages_between_requests():
    sched, dev = make(page_size=4)
    shared = list(range(10, 22))  # 12 tokens: 3 full pages
    first = sched.add_request("a", shared + [1], greedy(2))[0]
    run_to_completion(sched, dev)
    second = sched.add_request("b", shared + [2], greedy(2))[0]
    plan = sched.schedule()
    row = plan.seqs[0]
    assert row.num_new_tokens == 1 and row.context_len == 13  # only the last token is computed
    assert row.pages[:3] == (1, 2, 3)
    sched.update(plan, dev.execute(plan))
    run_to_completion(sched, dev)
    assert sched.allocator.stats.hits == 12
    assert second.output_token_ids == reference_continuation(shared + [2], 2)
    assert first.output_token_ids == reference_continuation(shared + [1], 2)


def test_a_prompt_that_is_all_cached_still_computes_its_last_token():
    sched, dev = make(page_size=4)
    prompt = list(range(30, 38))  # exactly 2 pages
    sched.add_request("a", prompt, greedy(1))
    run_to_completion(sched, dev)
    sched.add_request("b", prompt, greedy(1))
    plan = sched.schedule()
    assert plan.seqs[0].num_new_tokens == 4 and plan.seqs[0].pages[0] == 1  # page 2 is rewritten by "b"


def test_n_samples_share_the_prompt_pages():
    sched, dev = make(page_size=4)
    prompt = list(range(40, 50))  # 10 tokens: pages 1, 2 full, page 3 partial
    seqs = sched.add_request("n3", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=3))
    plan = sched.schedule()
    # the siblings join the leader's step: its K/V for the shared pages are written before anyone attends
    assert [(r.seq_id, r.num_new_tokens, r.pages[:2]) for r in plan.seqs] == [
        (0, 10, (1, 2)), (1, 2, (1, 2)), (2, 2, (1, 2))]
    assert [len(set(r.pages[2:]) & {3}) for r in plan.seqs] == [1, 0, 0]  # each has its own partial page
    assert sched.allocator.refcount(1) == 3
    sched.update(plan, dev.execute(plan))
    run_to_completion(sched, dev)
    expected = reference_continuation(prompt, 3)
    assert outputs(seqs) == [expected] * 3  # the fake model is deterministic
    assert len({s.seed for s in seqs}) == 3


def test_abort_at_any_point_frees_everything():
    sched, dev = make(page_size=4)
    sched.add_request("a", list(range(1, 30)), greedy(10))
    sched.add_request("b", [1, 2, 3], SamplingParams(n=2, max_tokens=5))
    plan = sched.schedule()
    sched.update(plan, dev.execute(plan))
    sched.abort_request("a")
    sched.abort_request("b")
    sched.abort_request("unknown")
    sched.check_invariants()
    assert not sched.has_work and sched.num_waiting == 0
    assert sched.allocator.num_used_pages == 0


def test_eos_and_stop_tokens_and_min_tokens():
    sched, dev = make()
    prompt = [3, 1, 4]
    expected = reference_continuation(prompt, 8)
    sched.eos_token_ids = frozenset({expected[2]})
    a = sched.add_request("eos", prompt, greedy(8))[0]
    b = sched.add_request("ignore", prompt, greedy(8, ignore_eos=True))[0]
    c = sched.add_request("stop_id", prompt, greedy(8, ignore_eos=True, stop_token_ids=(expected[4],)))[0]
    run_to_completion(sched, dev)
    assert (a.output_token_ids, a.finish_reason) == (expected[:3], "stop")
    assert (b.output_token_ids, b.finish_reason) == (expected, "length")
    assert (c.output_token_ids, c.finish_reason, c.stop_reason) == (expected[:5], "stop", expected[4])


def test_rejects_a_request_id_in_use():  # lengths are validated before the scheduler: tests/test_validation.py
    sched, _ = make(max_model_len=16)
    sched.add_request("z", list(range(10)), greedy(6))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("z", [1], greedy(1))


def test_priority_orders_the_waiting_queue():
    sched, dev = make(max_num_seqs=1)
    sched.add_request("low", [1, 2], greedy(1), priority=5)
    sched.add_request("high", [3, 4], greedy(1), priority=0)
    plan = sched.schedule()
    assert sched.sequences[plan.seqs[0].seq_id].request_id == "high"


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_aborts_keeps_invariants_and_frees_all_pages(seed):
    rng = random.Random(seed)
    sched, dev = make(num_pages=24, page_size=4, max_num_seqs=6, budget=24, max_model_len=64)
    expected, live = {}, []
    in_flight = []
    for step in range(400):
        if rng.random() < 0.3 and step < 300:
            rid = f"r{step}"
            prompt = [rng.randint(1, 5) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(n=rng.choice([1, 1, 2]), temperature=0.0, max_tokens=rng.randint(1, 20))
            seqs = sched.add_request(rid, prompt, params)
            expected[rid] = (prompt, seqs)
            live.append(rid)
        if live and rng.random() < 0.05:
            rid = live.pop(rng.randrange(len(live)))
            sched.abort_request(rid)
            expected.pop(rid)
        plan = sched.schedule()
        if not plan.is_empty:
            in_flight.append((plan, dev.execute(plan)))
        if len(in_flight) > 1 or (in_flight and plan.is_empty):
            sched.update(*in_flight.pop(0))
        sched.check_invariants()
    while in_flight:
        sched.update(*in_flight.pop(0))
    run_to_completion(sched, dev, lag=1)
    assert sched.allocator.num_used_pages == 0
    for prompt, seqs in expected.values():
        for s in seqs:
            assert s.finish_reason == "length"
            assert s.output_token_ids == reference_continuation(prompt, s.params.max_tokens)


def test_update_ignores_results_for_sequences_finished_meanwhile():
    sched, dev = make()
    [seq] = sched.add_request("a", [1, 2, 3], greedy(5))
    plan = sched.schedule()
    tokens = dev.execute(plan)
    sched.abort_request("a")
    assert sched.update(plan, tokens) == []
    assert seq.finish_reason == "abort"
    sched.check_invariants()


def test_host_side_bookkeeping_never_imports_jax():
    root = pathlib.Path(__file__).resolve().parents[1] / "jaxserve"
    files = list((root / "scheduler").glob("*.py")) + [root / "kv" / "allocator.py", root / "sampling_params.py",
             root / "validation.py", root / "lora" / "__init__.py", root / "lora" / "request.py",
             root / "lora" / "slots.py", root / "structured" / "params.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("jax", "flax", "pallas_kernels")) or name.startswith("jaxserve"), (
                    f"{path.name} imports {name}")
                if name.startswith("jaxserve."):
                    target = root.parent / (name.replace(".", "/") + ".py")
                    assert target in files or target.name == "__init__.py", f"{path.name} imports {name}"


def test_sampled_token_rows_line_up_with_the_plan():
    sched, dev = make()
    sched.add_request("a", [1, 2], greedy(1))
    plan = sched.schedule()
    updates = sched.update(plan, [SampledToken(7, -0.5, ((7, -0.5),))])
    assert updates[0].tokens[0].token_id == 7 and updates[0].finished


def test_aborting_a_sibling_that_waits_with_shared_prompt_pages_frees_them():
    """n = 2 with one free slot: once the leader has computed the prompt, its sibling waits for a slot holding
    shared prompt pages. Aborting the request must give those back (the soak found them leaked)."""
    sched, dev = make(max_num_seqs=1)
    sched.add_request("n2", list(range(1, 11)), SamplingParams(n=2, temperature=0.0, max_tokens=8))
    plan = sched.schedule()
    sched.update(plan, dev.execute(plan))
    [sibling] = [s for s in sched.waiting if s.request_id == "n2"]
    assert sibling.pages  # the prompt pages it shares with the leader
    sched.abort_request("n2")
    sched.check_invariants()
    assert sched.allocator.num_used_pages == 0 and not sched.has_requests


@pytest.mark.parametrize("late_masks", [True, False])
def test_constrained_sequences_run_one_step_ahead_only_in_pure_decode_steps(late_masks):
    """A constrained sequence's mask needs its newest token. With late_masks it decodes while that token is in
    flight, but only in a step with no prompt work (the engine's split executables are decode shapes); without,
    it waits for the token. Either way every token is the one the sequence would get alone."""
    config = SchedulerConfig(8, 32, 128, 4, late_masks=late_masks)
    sched = Scheduler(config, PageAllocator(64, 4, True), eos_token_ids=())
    dev = FakeDevice(64, 4, config.num_slots)
    constrained = SamplingParams(temperature=0.0, max_tokens=8,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    c, = sched.add_request("c", [1, 2, 3], constrained)
    u, = sched.add_request("u", [4, 5], greedy(8))
    first = sched.schedule()
    first_result = dev.execute(first)
    second = sched.schedule()  # both tokens still in flight: a pure decode step
    assert second.is_decode and {r.request_id for r in second.seqs} == ({"c", "u"} if late_masks else {"u"})
    assert second.late_mask == late_masks
    sched.update(first, first_result)
    second_result = dev.execute(second)
    w, = sched.add_request("w", [6, 7, 8], greedy(2))
    third = sched.schedule()  # a prompt to prefill: "c" waits for its token again
    assert {r.request_id for r in third.seqs} == ({"u", "w"} if late_masks else {"c", "u", "w"})
    assert not third.late_mask
    pending = [(third, dev.execute(third))]
    sched.update(second, second_result)
    while sched.has_work:  # on, one step ahead
        plan = sched.schedule()
        pending.append((plan, dev.execute(plan)))
        sched.update(*pending.pop(0))
        if plan.late_mask:
            assert plan.is_decode and not plan.new_slots
    sched.update(*pending.pop(0))
    assert c.output_token_ids == reference_continuation([1, 2, 3], 8)
    assert u.output_token_ids == reference_continuation([4, 5], 8)
    assert w.output_token_ids == reference_continuation([6, 7, 8], 2)
    assert sched.allocator.num_used_pages == 0
    sched.check_invariants()


def make_bursting(burst=4, max_batch=2, **kw):
    sched, dev = make(**kw)
    sched.config = dataclasses.replace(sched.config, decode_burst=burst, decode_burst_max_batch=max_batch)
    return sched, dev


@pytest.mark.parametrize("lag", [0, 1])
def test_decode_bursts_give_every_token_a_decode_step_would(lag):
    """Once nothing waits and no prompt runs, at most decode_burst_max_batch decoding sequences run decode_burst
    steps a call (fewer where max_tokens ends sooner): each burst row's context ends burst - 1 tokens past a
    decode step's, its pages cover it, its tokens are pending until read, and every token is the one the sequence
    would get alone; n > 1 samples burst too."""
    sched, dev = make_bursting(burst=4, max_batch=3)
    a, = sched.add_request("a", [1, 2, 3], greedy(11))
    b1, b2 = sched.add_request("b", [4, 5, 6, 7, 8], SamplingParams(n=2, temperature=0.0, max_tokens=6))
    seen, schedule = [], sched.schedule

    def checked_schedule():  # as each plan is made
        plan = schedule()
        if plan.is_burst:
            assert plan.is_decode and not plan.new_slots and len(plan.seqs) <= 3
            for row in plan.seqs:
                seq = sched.sequences[row.seq_id]
                assert row.num_new_tokens == row.burst and len(row.pages) * 4 >= row.context_len
                assert seq.num_computed_tokens == row.context_len and seq.num_pending_tokens >= row.burst
                assert row.burst == 4 or seq.num_tokens == seq.max_len
            seen.append(sorted(row.burst for row in plan.seqs))
        return plan

    sched.schedule = checked_schedule
    run_to_completion(sched, dev, lag=lag)
    assert seen and max(max(b) for b in seen) == 4 and min(min(b) for b in seen) < 4
    assert a.output_token_ids == reference_continuation([1, 2, 3], 11)
    assert b1.output_token_ids == b2.output_token_ids == reference_continuation([4, 5, 6, 7, 8], 6)
    assert sched.allocator.num_used_pages == 0


def test_a_burst_is_cut_at_the_token_that_stops_its_sequence():
    """A stop token inside a burst ends the sequence there: the tokens after it are dropped, its pages freed."""
    sched, dev = make_bursting(burst=4, max_batch=2)
    expected = reference_continuation([3, 1, 4], 12)
    stop = expected[5]
    seq, = sched.add_request("a", [3, 1, 4], greedy(12, stop_token_ids=[stop]))
    bursts = []
    run_to_completion(sched, dev, lag=1, on_step=lambda plan: bursts.append(plan.is_burst))
    assert any(bursts)
    assert seq.output_token_ids == expected[:expected.index(stop) + 1]
    assert seq.finish_reason == "stop" and seq.stop_reason == stop
    assert sched.allocator.num_used_pages == 0


def test_no_burst_while_requests_wait_prompts_run_grammars_decode_or_the_batch_is_large():
    sched, dev = make_bursting(burst=4, max_batch=2, budget=8)
    sched.add_request("a", [1, 2], greedy(30))
    plan = sched.schedule()  # a's prompt
    sched.update(plan, dev.execute(plan))
    assert sched.schedule().is_burst  # alone and decoding
    sched, dev = make_bursting(burst=4, max_batch=2, budget=8)
    sched.add_request("a", [1, 2], greedy(30))
    sched.update(plan := sched.schedule(), dev.execute(plan))
    sched.add_request("long", list(range(3, 23)), greedy(30))  # 20 prompt tokens: three chunks
    for _ in range(3):
        plan = sched.schedule()
        assert not plan.is_burst and any(r.num_new_tokens > 1 for r in plan.seqs)
        sched.update(plan, dev.execute(plan))
    sched.add_request("c", [7, 8], greedy(30))  # three running: above max_batch
    for _ in range(3):
        plan = sched.schedule()
        assert not plan.is_burst
        sched.update(plan, dev.execute(plan))
    constrained = SamplingParams(temperature=0.0, max_tokens=8,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    sched, dev = make_bursting(burst=4, max_batch=2)
    sched.add_request("g", [1, 2, 3], constrained)
    sched.update(plan := sched.schedule(), dev.execute(plan))
    assert not sched.schedule().is_burst


def test_bursts_under_preemption_and_aborts_keep_invariants_and_tokens():
    rng = random.Random(5)
    sched, dev = make_bursting(burst=3, max_batch=4, num_pages=14, page_size=4, budget=24, max_model_len=64,
                               prefix_caching=False)
    expected = {}
    for i in range(6):
        prompt = [rng.randint(1, 9) for _ in range(rng.randint(1, 12))]
        expected[f"r{i}"] = (prompt, sched.add_request(f"r{i}", prompt, greedy(rng.randint(1, 25))))
    sched.abort_request("r2")
    expected.pop("r2")
    bursts = []
    run_to_completion(sched, dev, lag=1, on_step=lambda plan: bursts.append(plan.is_burst))
    assert any(bursts) and sched.num_preemptions > 0
    for prompt, seqs in expected.values():
        assert seqs[0].output_token_ids == reference_continuation(prompt, seqs[0].params.max_tokens)
    assert sched.allocator.num_used_pages == 0
