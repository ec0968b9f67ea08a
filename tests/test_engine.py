"""Engine: batched, bucketed, paged output equals the unbatched reference; seeds; preemption; aborts; no recompiles."""

from __future__ import annotations

import dataclasses
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.models.llama import _random_builder, random_model
from jaxserve.sampling_params import SamplingParams

MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                    dtype="float32")
ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=384,
                      decode_buckets=(1, 2, 4, 8), prefill_token_buckets=(16, 64),
                      context_buckets=(128, 384), kv_cache_memory=2**22, xla_optimization_level=0,
                      compilation_cache_dir="")


@pytest.fixture(scope="module")
def model():
    """A random model with weights large enough that greedy choices are far from ties."""
    m = random_model(MODEL, jnp.float32, seed=0)
    state = nnx.state(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda w: w * 8 if w.ndim >= 2 else w, state))
    return m


def test_random_models_compile_once_a_config_and_the_seed_picks_the_weights():
    """random_model's builder is compiled once per config and dtype; each call returns new arrays, equal for the same
    seed, different for another; a config that cannot be hashed (a list for a tuple) still builds."""
    random_model(MODEL, jnp.float32, seed=7)
    before = _random_builder.cache_info()
    a, b, c = (random_model(MODEL, jnp.float32, seed=s) for s in (7, 7, 8))
    after = _random_builder.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 3
    leaves = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (a, b, c)]
    assert all(np.array_equal(x, y) for x, y in zip(leaves[0], leaves[1], strict=True))
    assert not np.array_equal(leaves[0][0], leaves[2][0])
    assert a.layers.wq[...] is not b.layers.wq[...]
    odd = random_model(dataclasses.replace(MODEL, eos_token_ids=[2]), jnp.float32, seed=7)
    assert odd.cfg.eos_token_ids == [2]


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine(model, ENGINE, show_progress=False)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy continuation by full recomputation of one unpadded sequence at a time (no cache, no batching)."""
    forward = jax.jit(lambda tokens: model.forward_dense(tokens[None])[0])
    cache = {}

    def continue_greedy(prompt, num_tokens):
        key = (tuple(prompt), num_tokens)
        if key not in cache:
            tokens = list(prompt)
            for _ in range(num_tokens):
                padded = np.zeros(ENGINE.max_model_len, np.int32)
                padded[:len(tokens)] = tokens
                tokens.append(int(jnp.argmax(forward(padded)[len(tokens) - 1])))
            cache[key] = tokens[len(prompt):]
        return cache[key]

    return continue_greedy


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_staggered(engine, requests, per_step=3, on_step=None):
    """Adds `per_step` requests before each step, then steps to the end. Returns final outputs by id."""
    pending, finals = list(requests), {}
    while pending or engine.has_unfinished_requests():
        for request_id, prompt, params in pending[:per_step]:
            engine.add_request(request_id, prompt, params)
        pending = pending[per_step:]
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if on_step:
            on_step()
    return finals


def mixed_prompts(seed, count, max_len=300):
    rng = np.random.default_rng(seed)
    lengths = [1, max_len] + rng.integers(1, max_len, count - 2).tolist()
    return [rng.integers(0, MODEL.vocab_size, n).tolist() for n in lengths]


def test_batched_paged_greedy_equals_unbatched_reference(engine, reference):
    prompts = mixed_prompts(0, 32)
    requests = [(f"r{i}", p, greedy(1 + i % 12)) for i, p in enumerate(prompts)]
    finals = run_staggered(engine, requests, on_step=engine.core.scheduler.check_invariants)
    for request_id, prompt, params in requests:
        got = finals[request_id].outputs[0]
        assert got.token_ids == reference(prompt, params.max_tokens), request_id
        assert got.finish_reason == "length"
    assert engine.core.scheduler.allocator.num_used_pages == 0


def test_seeded_sampling_ignores_batch_composition(engine):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = list(range(5, 40))
    alone = run_staggered(engine, [("alone", prompt, params)])["alone"].outputs[0].token_ids
    crowd = [(f"c{i}", p, SamplingParams(temperature=1.0, max_tokens=8, seed=i, ignore_eos=True))
             for i, p in enumerate(mixed_prompts(1, 6, 100))]
    crowded = run_staggered(engine, crowd[:3] + [("crowded", prompt, params)] + crowd[3:])
    assert crowded["crowded"].outputs[0].token_ids == alone
    assert len(set(alone)) > 1


def test_unseeded_sampling_differs_between_requests(engine):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    finals = run_staggered(engine, [("u1", [1, 2, 3], params), ("u2", [1, 2, 3], params)])
    assert finals["u1"].outputs[0].token_ids != finals["u2"].outputs[0].token_ids


def test_preemption_gives_the_same_outputs(model, reference):
    small = ENGINE.replace(kv_cache_memory=60 * 8 * 2 * 2 * 2 * 16 * 4)  # 60 pages: far fewer than 8 x 384 tokens
    engine = LLMEngine(model, small, show_progress=False)
    prompts = mixed_prompts(2, 10, 120)
    requests = [(f"p{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    finals = run_staggered(engine, requests, per_step=10, on_step=engine.core.scheduler.check_invariants)
    assert engine.core.scheduler.num_preemptions > 0
    for request_id, prompt, params in requests:
        assert finals[request_id].outputs[0].token_ids == reference(prompt, 24), request_id
    assert engine.core.scheduler.allocator.num_used_pages == 0


def test_random_aborts_keep_invariants_and_free_every_page(engine):
    rng = random.Random(0)
    prompts = mixed_prompts(3, 24, 200)
    live = []
    for step in range(200):
        if prompts and rng.random() < 0.5:
            request_id = f"a{step}"
            n = rng.choice([1, 1, 2])
            engine.add_request(request_id, prompts.pop(), SamplingParams(n=n, max_tokens=rng.randint(1, 30),
                                                                         ignore_eos=True, temperature=0.7))
            live.append(request_id)
        if live and rng.random() < 0.2:
            output = engine.abort_request(live.pop(rng.randrange(len(live))))
            assert output is None or all(o.finish_reason is not None for o in output.outputs)
        engine.step()
        engine.core.scheduler.check_invariants()
        if not prompts and not engine.has_unfinished_requests():
            break
    engine.run_until_done()
    engine.core.scheduler.check_invariants()
    assert engine.core.scheduler.allocator.num_used_pages == 0
    assert not engine.processor.states and not engine.core.scheduler.has_requests


def test_mixed_traffic_never_compiles(engine):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.append(event) if "backend_compile" in event else None)
    run_staggered(engine, [("warm", [1, 2, 3], greedy(2))])  # first use of the slot-assign function
    before = len(compiles)
    prompts = mixed_prompts(4, 16, 300)
    requests = [(f"m{i}", p, SamplingParams(n=1 + i % 2, temperature=i % 3 * 0.5, top_k=i % 4 * 10,
                                            max_tokens=1 + i % 9, ignore_eos=True, logprobs=i % 2 * 3,
                                            repetition_penalty=1.2 if i % 5 == 0 else 1.0))
                for i, p in enumerate(prompts)]
    run_staggered(engine, requests, per_step=2)
    assert len(compiles) == before
    runner, shapes = engine.core.runner, engine.core.buckets.shapes()
    assert set(runner.executables) == set(shapes)  # one executable per step shape (and, once structured output
    assert runner.num_executables == len(shapes) + len(runner.forwards) + len(runner.samplers)  # ran, the halves)


def test_steps_update_the_cache_in_place(engine):
    kv = engine.core.runner.kv
    cache_type = f"f32[{','.join(map(str, kv.k.shape))}]"
    runner = engine.core.runner
    assert engine.core.prepare_late_masks(wait=True) and runner.forwards  # the split decode halves write it too
    for shape, executable in [*runner.executables.items(), *runner.forwards.items()]:
        analysis = executable.memory_analysis()
        assert analysis.alias_size_in_bytes >= engine.core.kv_plan.cache_bytes, shape  # donated cache = output cache
        copies = [line for line in executable.as_text().splitlines()
                  if re.search(rf"= {re.escape(cache_type)}\S* copy(-start)?\(", line)]
        assert not copies, (shape, copies)  # the scatter into the scanned cache happens in place


def test_logprobs_are_normalised_and_include_the_sampled_token(engine):
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
    out = run_staggered(engine, [("lp", [7, 8, 9], params)])["lp"].outputs[0]
    assert len(out.logprobs) == 4
    for entry in out.logprobs:
        assert len(entry.top) == 5 and entry.top[0][0] == entry.token_id  # greedy: the best token
        assert entry.logprob == pytest.approx(entry.top[0][1], abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))


def test_prompt_logprobs_match_the_reference_forward(engine, model):
    prompt = mixed_prompts(5, 3, 90)[2]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, ignore_eos=True)
    out = run_staggered(engine, [("plp", prompt, params)])["plp"]
    lp = jax.nn.log_softmax(model.forward_dense(jnp.array([prompt]))[0], axis=-1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(float(lp[pos - 1, prompt[pos]]), abs=1e-4)
        assert len(entry.top) == 2


def test_prompt_logprobs_of_a_one_token_prompt(engine, reference):
    """A one-token prompt's first step is decode-shaped; asking for prompt logprobs runs it in a prefill shape."""
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    out = run_staggered(engine, [("one", [11], params)])["one"]
    assert out.prompt_logprobs == [None]
    assert list(out.outputs[0].token_ids) == reference([11], 3)


def test_n_samples_share_a_prompt_and_differ(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = run_staggered(engine, [("n", list(range(1, 50)), params)])["n"]
    samples = [o.token_ids for o in out.outputs]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(s) == 10 for s in samples) and len({tuple(s) for s in samples}) == 3


def test_penalties_bias_and_min_tokens(engine, reference):
    prompt = [11, 12, 13, 14]
    plain = reference(prompt, 6)
    biased = run_staggered(engine, [("b", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                 logit_bias={plain[0]: -100.0, 99: 100.0}))])
    assert biased["b"].outputs[0].token_ids == [99] * 6
    rep = run_staggered(engine, [("r", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                              frequency_penalty=2.0, presence_penalty=2.0))])
    tokens = rep["r"].outputs[0].token_ids
    assert max(tokens.count(t) for t in set(tokens)) <= 3  # heavy penalties spread the choices
    engine.core.scheduler.eos_token_ids = frozenset({plain[0]})
    try:
        stopped = run_staggered(engine, [("e", prompt, SamplingParams(temperature=0.0, max_tokens=6))])
        held = run_staggered(engine, [("m", prompt, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3))])
    finally:
        engine.core.scheduler.eos_token_ids = frozenset()
    assert stopped["e"].outputs[0].token_ids == [plain[0]] and stopped["e"].outputs[0].finish_reason == "stop"
    assert len(held["m"].outputs[0].token_ids) >= 3


def test_decode_bursts_give_the_tokens_single_decode_steps_give(model, engine):
    """The CPU default runs small decode batches as bursts (several decode steps in one executable call): greedy,
    seeded sampling, penalties, min_tokens, logprobs, stop tokens and n > 1 come out token for token as with
    --decode-burst 1, and the bursting engine did run bursts, with fewer calls."""
    assert engine.core.buckets.burst_tokens > 1 and engine.core.scheduler.config.decode_burst > 1
    plain = LLMEngine(model, ENGINE.replace(decode_burst=1), show_progress=False)
    assert plain.core.buckets.burst_tokens == 1
    prompt = list(range(7, 30))
    stop = run_staggered(plain, [("s", prompt[:14], greedy(20))])["s"].outputs[0].token_ids[9]  # request 4's
    params = [greedy(45), SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=23, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=17, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, stop_token_ids=[stop]),
              SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]),
              SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=13, ignore_eos=True)]
    got = {}
    for name, e in (("plain", plain), ("burst", engine)):
        first = e.core.stats.num_steps
        finals = run_staggered(e, [(f"{name}{i}", prompt[:10 + i], p) for i, p in enumerate(params)], per_step=1)
        steps = list(e.core.stats.steps)[-(e.core.stats.num_steps - first):]
        got[name] = ([[(c.token_ids, c.finish_reason, [(lp.logprob, lp.top) for lp in c.logprobs or ()])
                       for c in finals[f"{name}{i}"].outputs] for i in range(len(params))],
                     len(steps), max(s.burst for s in steps))
        e.core.scheduler.check_invariants()
        assert e.core.scheduler.allocator.num_used_pages == 0
    (plain_out, plain_steps, plain_most), (burst_out, burst_steps, burst_most) = got["plain"], got["burst"]
    for i, (a, b) in enumerate(zip(plain_out, burst_out, strict=True)):
        assert len(a) == len(b)
        for (ta, fa, la), (tb, fb, lb) in zip(a, b, strict=True):
            assert ta == tb and fa == fb, (i, ta, tb)
            np.testing.assert_allclose([x for x, _ in la], [x for x, _ in lb], rtol=1e-5, atol=1e-5)
            assert [[t for t, _ in top] for _, top in la] == [[t for t, _ in top] for _, top in lb]
    assert plain_out[4][0][1] == "stop" and plain_out[4][0][0][-1] == stop
    assert plain_most == 1 and burst_most == engine.core.buckets.burst_tokens
    assert burst_steps < plain_steps
