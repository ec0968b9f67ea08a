"""Bucket ladders are checked at start-up against what the scheduler can plan, so no step fails at run time.

    decode     1..max_num_seqs rows                         --decode-buckets
    prefill    t = 1..max_num_batched_tokens tokens from     --prefill-token-buckets, --prefill-seq-buckets
               up to min(t, max_num_seqs) rows
    pages      up to ceil(max_model_len / page_size) a row   --context-buckets
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.engine.buckets import StepShape, engine_buckets
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.runner import ModelRunner
from jaxserve.models.llama import random_model
from jaxserve.quant.memory import kv_bytes_per_token
from jaxserve.sampling_params import SamplingParams

MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256,
                    dtype="float32")
BASE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, page_size=8, max_model_len=96,
                    xla_optimization_level=0, compilation_cache_dir="")


def error_of(config: EngineConfig, attention: str = "xla") -> str:
    with pytest.raises(ConfigError) as info:
        engine_buckets(config, config.max_model_len, attention)
    return str(info.value)


def test_a_decode_ladder_short_of_max_num_seqs_is_refused():
    assert error_of(BASE.replace(decode_buckets=(1, 2, 4))) == (
        "--decode-buckets 1,2,4 has no bucket for 8 sequences (max_num_seqs 8): add 8")


def test_a_token_ladder_short_of_the_token_budget_is_refused():
    assert error_of(BASE.replace(prefill_token_buckets=(8, 16))) == (
        "--prefill-token-buckets 8,16 has no bucket for 32 tokens (max_num_batched_tokens 32): add 32")


def test_a_sequence_ladder_short_of_max_num_seqs_is_refused():
    message = error_of(BASE.replace(prefill_token_buckets=(16, 32), prefill_seq_buckets=(2, 4)))
    assert message == ("--prefill-seq-buckets 2,4 has no bucket for a step of 5 tokens from 5 sequences "
                       "(max_num_seqs 8): add 8 (each S pairs with the token buckets T >= S)")
    engine_buckets(BASE.replace(prefill_token_buckets=(16, 32), prefill_seq_buckets=(2, 4, 8)), 96, "xla")


def test_a_context_ladder_short_of_max_model_len_is_refused():
    assert error_of(BASE.replace(context_buckets=(32, 64))) == (
        "--context-buckets 32,64 has no bucket for a context of 96 tokens (12 pages of 8) (max_model_len 96): "
        "add 96")


def test_default_ladders_cover_every_configuration():
    for seqs, tokens, max_len, page in [(1, 1, 8, 8), (8, 32, 96, 8), (64, 2048, 8192, 16), (5, 7, 100, 16),
                                        (300, 100, 1000, 32), (64, 2048, 4096, 16)]:
        config = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, page_size=page, max_model_len=max_len)
        for attention in ("xla", "pallas"):
            engine_buckets(config, max_len, attention)


def test_decode_bursts_run_in_the_small_decode_shapes_only_where_they_may():
    """With the CPU kernels the default bursts 8 steps in the decode shapes a batch of up to
    decode_burst_max_batch (4) sequences lands in: no extra shape. Off elsewhere by default, with speculative
    decoding and across hosts; a burst length below 1 is refused."""
    cpu = engine_buckets(BASE, 96, "cpu")
    assert cpu.burst_tokens == 8 and cpu.burst_batch == 4
    assert [b for b in cpu.decode_sizes if cpu.bursts(StepShape("decode", b, b, cpu.page_sizes[0]))] == [1, 2, 4]
    assert engine_buckets(BASE.replace(decode_burst=1), 96, "cpu").shapes() == cpu.shapes()
    assert not any(cpu.bursts(shape) for shape in cpu.shapes() if shape.kind != "decode")
    odd = engine_buckets(BASE.replace(decode_buckets=(1, 3, 8), decode_burst_max_batch=2), 96, "cpu")
    assert [b for b in odd.decode_sizes if odd.bursts(StepShape("decode", b, b, 12))] == [1, 3]
    for config, attention in [(BASE, "xla"), (BASE, "pallas"), (BASE.replace(speculative_method="ngram"), "cpu"),
                              (BASE.replace(decode_burst=4, num_processes=2), "cpu")]:
        assert engine_buckets(config, 96, attention).burst_tokens == 1
    assert engine_buckets(BASE.replace(decode_burst=3), 96, "pallas").burst_tokens == 3
    assert "decode_burst must be at least 1" in error_of(BASE.replace(decode_burst=0), "cpu")


def random_ladder(rng: random.Random, limit: int) -> tuple[int, ...]:
    return tuple(sorted(rng.sample(range(1, limit + 1), rng.randint(1, min(4, limit)))))


def test_every_plan_shape_of_an_accepted_ladder_has_a_bucket():
    """Random ladders: an accepted table fits every (tokens, rows, pages) the scheduler can plan; a refused one
    misses one."""
    rng = random.Random(0)
    accepted = 0
    for _ in range(300):
        seqs, tokens, page = rng.randint(1, 12), rng.randint(1, 40), rng.choice([4, 8, 16])
        max_len = rng.randint(2, 120)
        max_pages = -(-max_len // page)
        config = EngineConfig(
            max_num_seqs=seqs, max_num_batched_tokens=tokens, page_size=page, max_model_len=max_len,
            decode_buckets=rng.choice([None, random_ladder(rng, seqs + 2)]),
            prefill_token_buckets=rng.choice([None, random_ladder(rng, tokens + 4)]),
            prefill_seq_buckets=rng.choice([None, random_ladder(rng, seqs + 2)]),
            context_buckets=rng.choice([None, random_ladder(rng, max_len + 8)]))
        try:
            table = engine_buckets(config, max_len, "xla")
        except ConfigError:
            assert not covers_every_plan(config, max_pages)
            continue
        accepted += 1
        assert covers_every_plan(config, max_pages), config
        for pages in range(1, max_pages + 1):
            for rows in range(1, seqs + 1):
                table.decode_shape(rows, pages)
            for t in range(1, tokens + 1):
                for rows in range(1, min(t, seqs) + 1):
                    shape = table.prefill_shape(t, rows, pages)
                    assert shape.tokens >= t and shape.seqs >= rows and shape.pages >= pages
    assert accepted > 50


def covers_every_plan(config: EngineConfig, max_pages: int) -> bool:
    """The brute-force answer: does the unchecked table fit every plan?"""
    from jaxserve.engine.buckets import BucketError, BucketTable
    c = config
    context = c.context_buckets and tuple(-(-t // c.page_size) for t in c.context_buckets)
    table = BucketTable.build(c.max_num_seqs, c.max_num_batched_tokens, max_pages, decode_sizes=c.decode_buckets,
                              token_sizes=c.prefill_token_buckets, seq_sizes=c.prefill_seq_buckets,
                              context_pages=context)
    try:
        for rows in range(1, c.max_num_seqs + 1):
            table.decode_shape(rows, max_pages)
        for t in range(1, c.max_num_batched_tokens + 1):
            table.prefill_shape(t, min(t, c.max_num_seqs), max_pages)
    except BucketError:
        return False
    return True


@pytest.fixture(scope="module")
def model():
    return random_model(MODEL, jnp.float32, seed=0)


def test_the_engine_refuses_a_bad_ladder_before_compiling(model, monkeypatch):
    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled before checking the ladders")

    monkeypatch.setattr(ModelRunner, "compile_shapes", no_compiling)
    with pytest.raises(ConfigError, match=r"--decode-buckets 1,2,4 has no bucket for 8 sequences"):
        LLMEngine(model, BASE.replace(decode_buckets=(1, 2, 4)), show_progress=False)


PAGE_BYTES = kv_bytes_per_token(MODEL, "auto", "float32") * BASE.page_size
LADDERS = {
    "one rung each": dict(decode_buckets=(8,), prefill_token_buckets=(32,), prefill_seq_buckets=(8,),
                          context_buckets=(96,)),
    "uneven": dict(decode_buckets=(1, 3, 8), prefill_token_buckets=(5, 32), prefill_seq_buckets=(2, 8),
                   context_buckets=(40, 96)),
    "defaults": dict(max_num_seqs=6, max_num_batched_tokens=24),
}


# "uneven" (odd sizes on every ladder) in the default run; the two simpler ladders (~20 s each) with -m slow
@pytest.mark.parametrize("ladder", [name if name == "uneven" else pytest.param(name, marks=pytest.mark.slow)
                                    for name in sorted(LADDERS)])
def test_random_traffic_never_misses_a_bucket(model, ladder):
    """Random prompt lengths, max_tokens, n, arrivals and aborts, shared prefixes, and a KV cache of 30 pages (a
    sequence may need 12): preemption happens, and no step ever fails to find its shape."""
    config = BASE.replace(kv_cache_memory=30 * PAGE_BYTES, **LADDERS[ladder])
    engine = LLMEngine(model, config, show_progress=False)
    rng = random.Random(ladder)
    shared = np.random.default_rng(0).integers(0, MODEL.vocab_size, 40).tolist()
    live, shapes = [], set()
    dispatch = engine.core.runner.dispatch

    def recording(plan, flags):
        pending = dispatch(plan, flags)
        shapes.add(pending.shape)
        return pending

    engine.core.runner.dispatch = recording
    for step in range(300):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            live.append(add_random_request(engine, rng, f"r{step}-{len(live)}", shared))
        if live and rng.random() < 0.1:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        engine.step()
        engine.core.scheduler.check_invariants()
    engine.run_until_done()
    engine.core.scheduler.check_invariants()
    assert engine.core.scheduler.allocator.num_used_pages == 0
    assert engine.core.scheduler.num_preemptions > 0
    assert {s.kind for s in shapes} == {"decode", "prefill"}
    assert max(s.pages for s in shapes) == engine.core.buckets.page_sizes[-1]  # a full-length sequence ran


def add_random_request(engine: LLMEngine, rng: random.Random, request_id: str, shared: list[int]) -> str:
    max_len = engine.max_model_len
    length = rng.choice([1, 2, rng.randint(1, 20), rng.randint(1, max_len - 1), max_len - 1])
    prompt = (shared[:rng.randint(1, len(shared))] if rng.random() < 0.3 else [])
    prompt = (prompt + [rng.randrange(MODEL.vocab_size) for _ in range(length)])[:length]
    room = max_len - len(prompt)
    max_tokens = rng.choice([None, 1, rng.randint(1, room)])
    params = SamplingParams(n=rng.choice([1, 1, 1, 2]), max_tokens=max_tokens, ignore_eos=True,
                            temperature=rng.choice([0.0, 0.8]), prompt_logprobs=rng.choice([None, None, 1]))
    engine.add_request(request_id, prompt, params)
    return request_id
