"""The bottleneck verdict on four synthetic workloads run by a real engine on this CPU (the parts are tested by
hand in test_metrics_accounting.py; the numbers measured here are in docs/metrics.md).

On CPU the "device" is XLA's thread pool on the same cores as the Python host, so the workloads are chosen to
make each regime unambiguous whatever the load on the machine:

  bandwidth  batch-1 decode at a 1,024-token context on a 7.5M-parameter float32 model: every step reads the
             30 MB of weights and the KV cache for 2 FLOPs per weight, an arithmetic intensity near 0.5 FLOP/byte,
             well below any CPU's ridge point (measured here: 1.6-2.8 FLOP/byte), and each step keeps the device busy
             far longer (7-16 ms here, XLA's default optimisation level) than the host needs to plan the next
             (~1 ms), at 9-16% of the measured copy bandwidth: above the latency verdict's 5%;
  compute    prompts of 255 tokens with one output token on the same model: every step is a 256-token prefill,
             ~100 FLOP per byte, forty times the ridge point or more;
  host       a 1-layer, 32-wide model flooded with 512 requests of 8 prompt tokens and 2 output tokens: the device
             step is tiny and the host's per-request work (admission, slot assignment, detokenization, outputs)
             dominates, so the device idles most of the time;
  latency    one request on a 16-layer, 16-wide model: the host keeps up (the device is busy), but each step
             moves ~0.1 MB through 16 layers of small operations, so it reaches about 1% of either ceiling: the
             fixed cost of running the step's operations sets its time.

Compute vs bandwidth is decided by intensity against the ridge point (a ratio of the two ceilings, which moves
little with load); host vs device by the idle fraction; latency by how far below both ceilings the steps stay.
Each test prints its numbers (pytest -s shows them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.models.llama import random_model
from jaxserve.observability.bottleneck import LATENCY_CEILING_FRACTION, model_cost, window_report
from jaxserve.observability.ceilings import device_ceilings
from jaxserve.sampling_params import SamplingParams

MEDIUM = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=384, intermediate_size=1024,
                     num_layers=4, num_heads=6, num_kv_heads=6, head_dim=64, max_position_embeddings=2048,
                     dtype="float32")
MEDIUM_ENGINE = EngineConfig(max_num_seqs=1, max_num_batched_tokens=256, page_size=16, max_model_len=1088,
                             decode_buckets=(1,), prefill_token_buckets=(256,), prefill_seq_buckets=(1,),
                             context_buckets=(1088,), kv_cache_memory=2**26, compilation_cache_dir="")
TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=32, intermediate_size=64,
                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=512,
                   dtype="float32")
TINY_ENGINE = EngineConfig(max_num_seqs=64, max_num_batched_tokens=256, page_size=8, max_model_len=32,
                           decode_buckets=(64,), prefill_token_buckets=(256,), prefill_seq_buckets=(64,),
                           context_buckets=(32,), kv_cache_memory=2**22, compilation_cache_dir="")
# 16 layers 16 wide: a decode step runs 16 layers' worth of small operations for ~0.1 MB of weights.
DEEP = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=16, intermediate_size=32,
                   num_layers=16, num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=512,
                   dtype="float32")
DEEP_ENGINE = TINY_ENGINE.replace(decode_buckets=(1, 64), max_model_len=64, context_buckets=(64,))
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ceilings(tmp_path_factory):
    """Measured now (not from a cache another run wrote), once for the module."""
    return device_ceilings(jax.devices()[0], "float32", tmp_path_factory.mktemp("ceilings"))


@pytest.fixture(scope="module")
def medium_engine():
    return LLMEngine(random_model(MEDIUM, jnp.float32), MEDIUM_ENGINE, show_progress=False)


def run(engine: LLMEngine, prompts, params: SamplingParams, tag: str) -> list:
    """Runs the requests to completion; returns the step records of the run."""
    first = engine.core.stats.num_steps
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    engine.run_until_done()
    return list(engine.core.stats.steps)[len(engine.core.stats.steps) - (engine.core.stats.num_steps - first):]


def describe(name: str, report, ceilings) -> str:
    return (f"{name}: verdict {report.verdict} over {report.steps} steps; device busy {report.busy_seconds:.3f}s, "
            f"idle {report.idle_seconds:.3f}s (idle fraction {report.idle_fraction:.2f}); bandwidth "
            f"{report.achieved_bandwidth / 1e9:.2f} GB/s = {report.bandwidth_fraction:.3f} of "
            f"{ceilings.bandwidth / 1e9:.1f}; compute {report.achieved_flops / 1e9:.2f} GFLOP/s = "
            f"{report.compute_fraction:.3f} of {ceilings.flops / 1e9:.1f}; intensity "
            f"{report.work.flops / report.work.bytes:.1f} FLOP/byte vs ridge {ceilings.ridge_point:.1f}")


def test_long_context_batch_1_decode_is_bandwidth_bound(medium_engine, ceilings):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, MEDIUM.vocab_size, 1023).tolist()
    records = run(medium_engine, [prompt], SamplingParams(max_tokens=48, **GREEDY), "decode")
    decode = [r for r in records if r.shape.kind == "decode"]
    report = window_report(decode[4:], model_cost(medium_engine.core), ceilings)  # steady state, context >= 1,027
    print(describe("batch-1 decode", report, ceilings))
    assert report.verdict == "bandwidth"
    assert report.bandwidth_fraction > 2 * report.compute_fraction
    assert report.idle_fraction < 0.3


def test_large_prefills_are_compute_bound(medium_engine, ceilings):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, MEDIUM.vocab_size, 255).tolist() for _ in range(4)]
    records = run(medium_engine, prompts, SamplingParams(max_tokens=1, **GREEDY), "prefill")
    assert all(r.shape.kind == "prefill" and r.num_tokens == 255 for r in records)
    report = window_report(records, model_cost(medium_engine.core), ceilings)
    print(describe("256-token prefills", report, ceilings))
    assert report.verdict == "compute"
    assert report.compute_fraction > 10 * report.bandwidth_fraction
    assert report.idle_fraction < 0.3


def test_flood_of_short_requests_on_a_tiny_model_is_host_bound(ceilings):
    engine = LLMEngine(random_model(TINY, jnp.float32), TINY_ENGINE, show_progress=False)
    rng = np.random.default_rng(2)
    params = SamplingParams(max_tokens=2, **GREEDY)
    run(engine, [rng.integers(3, 250, 8).tolist() for _ in range(512)], params, "warmup")
    records = run(engine, [rng.integers(3, 250, 8).tolist() for _ in range(512)], params, "flood")
    report = window_report(records, model_cost(engine.core), ceilings)
    print(describe("flood of short requests", report, ceilings))
    assert report.verdict == "host"
    assert report.idle_fraction > 0.6


def test_one_request_on_a_deep_narrow_model_is_latency_bound(ceilings):
    """Light load on a model whose steps are all fixed cost: one sequence, so the host keeps up (no host
    verdict), but a decode step moves ~0.1 MB and does ~0.03 MFLOP through 16 layers of small operations, so
    what sets its time is the cost of running those operations at all: near neither ceiling."""
    engine = LLMEngine(random_model(DEEP, jnp.float32), DEEP_ENGINE, show_progress=False)
    rng = np.random.default_rng(3)
    records = run(engine, [rng.integers(3, DEEP.vocab_size, 8).tolist()], SamplingParams(max_tokens=56, **GREEDY),
                  "light")
    # On the CPU kernels a decode record is a burst of up to 8 steps: the first is left out (warm-up) and the verdict
    # is over the other six, not over a single burst's timing.
    decode = [r for r in records if r.shape.kind == "decode"]
    report = window_report(decode[1:], model_cost(engine.core), ceilings)
    print(describe("one request on a deep narrow model", report, ceilings))
    assert report.verdict == "latency"
    assert max(report.bandwidth_fraction, report.compute_fraction) < LATENCY_CEILING_FRACTION
    assert report.idle_fraction < 0.5  # busy: not a host verdict in disguise
