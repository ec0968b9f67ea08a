"""Speculative decoding through the engine: greedy output with n-gram proposals equals greedy output without them,
token for token (a random model against its dense reference, every parity fixture family, the demo model), in
batches with staggered arrivals, preemption and prefix hits; random aborts free every page; logprobs stay the
target's; mixed traffic never compiles."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.checkpoint import load_model
from jaxserve.config import ConfigError, EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from test_engine import ENGINE, MODEL, greedy, mixed_prompts, model, reference, run_staggered  # noqa: F401

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = sorted(p.parent.name for p in FIXTURES.glob("*/reference_logits.npz"))
DEMO = Path(__file__).resolve().parents[1] / "checkpoints" / "demo"
DEMO_TEXTS = ["def read_config(path):\n", "import os\nimport sys\n\n\ndef main():\n",  # prompts for the demo
              "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def ",
              "for i in range(10):\n    for j in range(10):\n        print(i, j)\n"]


def ngram(config: EngineConfig, k: int = 3, **changes) -> EngineConfig:
    return config.replace(speculative_method="ngram", num_speculative_tokens=k,
                          speculative_disable_batch_size=None, **changes)


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts made of a repeated motif, so n-gram lookups find matches from the first step."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, MODEL.vocab_size, int(rng.integers(2, 8))).tolist() * 60)[:int(rng.integers(8, 120))]
            for _ in range(count)]


def outputs(finals, requests):
    return {rid: finals[rid].outputs[0].token_ids for rid, _, _ in requests}


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3,
                               pytest.param(5, marks=pytest.mark.slow)])
def test_ngram_greedy_equals_the_dense_reference(model, reference, k):
    engine = LLMEngine(model, ngram(ENGINE, k), show_progress=False)
    prompts = repetitive_prompts(0, 10) + mixed_prompts(0, 6, 200)  # the same for every K: one reference
    requests = [(f"s{i}", p, greedy(8 + 4 * (i % 6))) for i, p in enumerate(prompts)]
    finals = run_staggered(engine, requests, per_step=2, on_step=engine.core.scheduler.check_invariants)
    for request_id, prompt, params in requests:
        assert finals[request_id].outputs[0].token_ids == reference(prompt, params.max_tokens), request_id
        assert finals[request_id].outputs[0].finish_reason == "length"
    spec = engine.core.stats_snapshot().spec_decode
    assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens  # both paths ran
    assert engine.core.scheduler.allocator.num_used_pages == 0


@pytest.mark.slow
def test_ngram_greedy_with_preemption_and_prefix_hits(model, reference):
    small = ngram(ENGINE, 3, kv_cache_memory=60 * 8 * 2 * 2 * 2 * 16 * 4)  # 60 pages: far fewer than needed
    preemption_and_prefix_hits_keep_greedy_output(LLMEngine(model, small, show_progress=False), reference)


def preemption_and_prefix_hits_keep_greedy_output(engine, reference) -> None:
    """Prompts sharing a prefix, in an engine with too few pages: preemptions, prefix hits and accepted proposals
    all happen, and every output is the dense reference's; every page is free at the end."""
    shared = repetitive_prompts(7, 1)[0][:48]
    prompts = [shared + p[:40] for p in repetitive_prompts(8, 6)] + repetitive_prompts(9, 4)
    requests = [(f"p{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    finals = run_staggered(engine, requests, per_step=10, on_step=engine.core.scheduler.check_invariants)
    stats = engine.core.stats_snapshot()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_decode.num_accepted_tokens > 0
    for request_id, prompt, params in requests:
        assert finals[request_id].outputs[0].token_ids == reference(prompt, 24), request_id
    assert engine.core.scheduler.allocator.num_used_pages == 0


@pytest.fixture(scope="module")
def spec_engine(model):
    return LLMEngine(model, ngram(ENGINE, 3), show_progress=False)


def test_random_aborts_with_speculation_free_every_page(spec_engine):
    random_aborts_free_every_page(spec_engine, seed=1)


def random_aborts_free_every_page(engine, seed: int) -> None:
    """Random arrivals, aborts, n = 2, stop tokens and sampled rows against a speculating engine: every page is
    free at the end, nothing is left in the scheduler or the output processor."""
    rng = random.Random(seed)
    prompts = repetitive_prompts(10 * seed, 12) + mixed_prompts(10 * seed + 1, 12, 200)
    rng.shuffle(prompts)
    live = []
    for step in range(300):
        if prompts and rng.random() < 0.5:
            request_id = f"a{seed}-{step}"
            params = SamplingParams(n=rng.choice([1, 1, 2]), max_tokens=rng.randint(1, 30), ignore_eos=True,
                                    temperature=rng.choice([0.0, 0.7]), stop_token_ids=(rng.randrange(512),))
            engine.add_request(request_id, prompts.pop(), params)
            live.append(request_id)
        if live and rng.random() < 0.2:
            output = engine.abort_request(live.pop(rng.randrange(len(live))))
            assert output is None or all(o.finish_reason is not None for o in output.outputs)
        for output in engine.step():
            for sample in output.outputs:
                assert sample.finish_reason is None or len(sample.token_ids) <= 30
        engine.core.scheduler.check_invariants()
        if not prompts and not engine.has_unfinished_requests():
            break
    engine.run_until_done()
    engine.core.scheduler.check_invariants()
    assert engine.core.scheduler.allocator.num_used_pages == 0
    assert not engine.processor.states and not engine.core.scheduler.has_requests
    assert engine.core.stats_snapshot().spec_decode.num_drafts > 0


def test_logprobs_are_the_targets(spec_engine, model):
    plain = LLMEngine(model, ENGINE, show_progress=False)
    prompt = repetitive_prompts(12, 1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True)
    got = run_staggered(spec_engine, [("lp", prompt, params)])["lp"].outputs[0]
    want = run_staggered(plain, [("lp", prompt, params)])["lp"].outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs) == 20
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_seeded_sampling_with_speculation_ignores_batch_composition(spec_engine):
    seeded_sampling_ignores_batch_composition(spec_engine)


def seeded_sampling_ignores_batch_composition(engine) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    prompt = repetitive_prompts(13, 1)[0]
    alone = run_staggered(engine, [("alone", prompt, params)])["alone"].outputs[0].token_ids
    crowd = [(f"c{i}", p, SamplingParams(temperature=1.0, max_tokens=8, seed=i, ignore_eos=True))
             for i, p in enumerate(repetitive_prompts(14, 4))]
    crowded = run_staggered(engine, crowd[:2] + [("crowded", prompt, params)] + crowd[2:])
    assert crowded["crowded"].outputs[0].token_ids == alone


def test_mixed_traffic_with_speculation_never_compiles(spec_engine):
    mixed_traffic_never_compiles(spec_engine)


def mixed_traffic_never_compiles(engine) -> None:
    """Every kind of request after one warm-up request: no compile; every bucket shape (verify ones included)."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.append(event) if "backend_compile" in event else None)
    run_staggered(engine, [("warm", [1, 2, 3], greedy(2))])
    before = len(compiles)
    prompts = repetitive_prompts(15, 8) + mixed_prompts(16, 8, 300)
    requests = [(f"m{i}", p, SamplingParams(n=1 + i % 2, temperature=i % 3 * 0.5, top_k=i % 4 * 10,
                                            max_tokens=1 + i % 9, ignore_eos=True, logprobs=i % 2 * 3,
                                            repetition_penalty=1.2 if i % 5 == 0 else 1.0,
                                            prompt_logprobs=1 if i % 7 == 0 else None))
                for i, p in enumerate(prompts)]
    run_staggered(engine, requests, per_step=2)
    assert len(compiles) == before
    shapes = engine.core.buckets.shapes()
    assert set(engine.core.runner.executables) == set(shapes) and any(s.kind == "verify" for s in shapes)


def test_bad_speculative_settings_are_refused(model):
    with pytest.raises(ConfigError, match="num-speculative-tokens"):
        LLMEngine(model, ngram(ENGINE, 9), show_progress=False)
    with pytest.raises(ConfigError, match="speculative-method"):
        LLMEngine(model, ENGINE.replace(speculative_method="medusa"), show_progress=False)
    with pytest.raises(ConfigError, match="needs --speculative-model"):
        LLMEngine(model, ENGINE.replace(speculative_method="draft"), show_progress=False)
    with pytest.raises(ConfigError, match="ngram-min"):
        LLMEngine(model, ngram(ENGINE, 2, ngram_min=3, ngram_max=2), show_progress=False)


# ---- real checkpoints: every parity family, and the demo model -------------------------------------------------
FIXTURE_ENGINE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=128,
                              decode_buckets=(1, 2, 4), prefill_token_buckets=(16, 64), context_buckets=(128,),
                              kv_cache_memory=2**21, xla_optimization_level=0, compilation_cache_dir="")


def greedy_both_ways(model_dir, prompts, max_tokens, config=FIXTURE_ENGINE, k=3):
    model = load_model(model_dir, dtype="float32")
    requests = [(f"f{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    results = []
    for cfg in (config, ngram(config, k)):
        engine = LLMEngine(model, cfg, show_progress=False)
        results.append(outputs(run_staggered(engine, requests, per_step=2), requests))
        if cfg.speculative_method:
            results.append(engine.core.stats_snapshot().spec_decode)
    return results


@pytest.mark.parametrize("family", [f if f == "llama3.2" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])  # one family in the default run: each compiles 2 engines
def test_ngram_greedy_equals_plain_greedy_on_parity_fixtures(family, converted):
    prompts = [p["ids"] for p in json.loads((FIXTURES / family / "reference.json").read_text())["prompts"]]
    prompts += [p["ids"] + p["continuation"][:16] for p in json.loads(
        (FIXTURES / family / "reference.json").read_text())["prompts"]]  # continuations repeat: n-gram hits
    plain, speculative, spec = greedy_both_ways(converted(family), prompts, 32)
    assert speculative == plain
    assert spec.num_drafts > 0


@pytest.mark.slow
def test_ngram_greedy_equals_plain_greedy_on_the_demo_model():
    from jaxserve.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(DEMO)
    config = FIXTURE_ENGINE.replace(max_model_len=256, context_buckets=(256,))
    plain, speculative, spec = greedy_both_ways(DEMO, [tokenizer.encode(t) for t in DEMO_TEXTS], 64, config)
    assert speculative == plain
    assert spec.num_accepted_tokens > 0


def test_structured_output_is_refused_while_speculating(spec_engine):
    """The verify step does not apply a grammar's mask yet: a constrained request is a clear 400, not wrong JSON."""
    from jaxserve.structured.params import StructuredOutputsParams
    from jaxserve.validation import InvalidRequestError
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(InvalidRequestError, match="speculative decoding") as error:
        spec_engine.add_request("constrained", [1, 2, 3], params)
    assert error.value.param == "structured_outputs"
    assert not spec_engine.has_unfinished_requests()
