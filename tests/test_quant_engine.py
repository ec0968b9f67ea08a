"""The engine with quantized weights and quantized KV caches, in the greedy-equality style of test_engine.py.

Exactness: the batched, paged engine gives the same greedy tokens as `forward_dense` of the same model with the
same rounding (quantized weights; K/V rounded per token as the int8 / fp8 cache stores them). That makes the
dense path a faithful stand-in for the engine in bench/quant_accuracy.py.

Accuracy: the token agreement rate with the unquantized model over a fixed prompt set. Random test models are
chaotic (any perturbation soon changes a greedy choice), so the stated floors are checked on the trained demo
model (checkpoints/demo) and the test is skipped until it exists.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.models.kernels import resolve_matmul
from jaxserve.models.llama import random_model
from jaxserve.quant.kv import kv_storage_dtype
from jaxserve.quant.model import quantize_model
from jaxserve.sampling_params import SamplingParams

MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                    dtype="float32")
ENGINE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=128,
                      decode_buckets=(4,), prefill_token_buckets=(32,), prefill_seq_buckets=(4,),
                      context_buckets=(128,), kv_cache_memory=2**21, xla_optimization_level=0,
                      compilation_cache_dir="")
NEW_TOKENS = 10
DEMO = Path(__file__).resolve().parents[1] / "checkpoints" / "demo"


@pytest.fixture(scope="module")
def model():
    m = random_model(MODEL, jnp.float32, seed=1)
    nnx.update(m, jax.tree.map(lambda w: w * 8 if w.ndim >= 2 else w, nnx.state(m, nnx.Param)))
    return m


def prompts(count: int = 6, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, MODEL.vocab_size, int(n)).tolist() for n in [1, 40, *rng.integers(2, 60, count - 2)]]


def engine_greedy(model, config: EngineConfig, prompt_set) -> list[list[int]]:
    engine = LLMEngine(model, config, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompt_set):
        engine.add_request(str(i), p, params)
    finals = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()}
    assert engine.core.scheduler.allocator.num_used_pages == 0
    return [finals[str(i)] for i in range(len(prompt_set))]


def dense_greedy(model, prompt_set, kv_cache_dtype=None, length: int = 128) -> list[list[int]]:
    """One sequence at a time, recomputed from scratch for every token (no cache, no batching)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t[None], kv_cache_dtype=kv_cache_dtype)[0])
    out = []
    for prompt in prompt_set:
        tokens = list(prompt)
        for _ in range(NEW_TOKENS):
            padded = np.zeros(length, np.int32)
            padded[:len(tokens)] = tokens
            tokens.append(int(jnp.argmax(forward(state, padded)[len(tokens) - 1])))
        out.append(tokens[len(prompt):])
    return out


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_greedy_equals_dense_forward_with_the_same_rounding(model, kv_cache_dtype, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        got = engine_greedy(model, ENGINE.replace(kv_cache_dtype=kv_cache_dtype), prompts())
    expected = dense_greedy(model, prompts(), kv_storage_dtype(kv_cache_dtype, jnp.float32))
    assert got == expected
    name = "int8" if kv_cache_dtype == "int8" else "float8_e4m3fn"
    assert f"KV cache {name}" in caplog.text


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_weights_greedy_equals_their_dense_forward(model, scheme, caplog):
    quantized = quantize_model(model, scheme)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        got = engine_greedy(quantized, ENGINE, prompts())
    assert got == dense_greedy(quantized, prompts())
    matmul = resolve_matmul(ENGINE.matmul)  # on a CPU: the C++ kernel for one-row products, XLA for the rest
    assert f"weights {scheme} ({matmul} matmul, LM head float)" in caplog.text


def test_pallas_matmul_gives_the_xla_matmul_tokens(model):
    """matmul=pallas (the W8A16 kernel, interpreted on CPU) through the runner, with an int8 LM head too."""
    quantized = quantize_model(model, "int8", lm_head="int8")
    few = prompts(4)
    assert engine_greedy(quantized, ENGINE.replace(matmul="pallas"), few) == engine_greedy(quantized, ENGINE, few)


def test_kv_cache_budget_holds_more_tokens_in_smaller_dtypes(model):
    budget = ENGINE.replace(max_num_seqs=8, decode_buckets=(8,), prefill_seq_buckets=(8,), kv_cache_memory=2**17)
    pages = {}
    for name in ("auto", "int8", "fp8"):  # 8 sequences x 16 pages would take 129 pages; the budget is smaller
        engine = LLMEngine(model, budget.replace(kv_cache_dtype=name), show_progress=False)
        pages[name] = engine.core.kv_plan.num_pages
        assert engine.core.kv_plan.cache_bytes == sum(a.nbytes for a in jax.tree.leaves(engine.core.runner.kv))
    # float32: 64 bytes per head and token; int8: 16 + a 4-byte scale; fp8: 16
    assert pages["int8"] == pytest.approx(pages["auto"] * 64 / 20, abs=1)
    assert pages["fp8"] == pytest.approx(pages["auto"] * 4, abs=1)


# ---------------------------------------------------------------------------------------------- accuracy

# Floors for the trained demo model: greedy token agreement with the unquantized model (same prompts, position by
# position; a sequence that diverges keeps counting its later positions as disagreements). See bench/RESULTS.md.
DEMO_AGREEMENT_FLOORS = {"kv int8": 0.9, "kv fp8": 0.7, "weights int8": 0.85, "weights int4": 0.5}
DEMO_PROMPTS = ("def ", "import os\n", "class ", "    def __init__(self", "for i in range(", "return ",
                "if __name__ == '__main__':\n", "    raise ValueError(", "from collections import ",
                "    @property\n    def ", "try:\n    ", "with open(")


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return float(np.mean([x == y for s, t in zip(a, b) for x, y in zip(s, t)]))


@pytest.mark.skipif(not (DEMO / "jaxserve.json").exists(), reason="checkpoints/demo is not trained yet")
def test_demo_model_agreement_with_the_unquantized_model():
    from jaxserve.checkpoint import load_model
    from jaxserve.tokenizer import load_tokenizer
    demo = load_model(DEMO, dtype="float32")
    tokenizer = load_tokenizer(DEMO, model_type=demo.cfg.family)
    prompt_set = [tokenizer.encode(p) for p in DEMO_PROMPTS]
    length = demo.cfg.max_position_embeddings
    base = dense_greedy(demo, prompt_set, length=length)
    rates = {"kv int8": agreement(dense_greedy(demo, prompt_set, jnp.int8, length), base),
             "kv fp8": agreement(dense_greedy(demo, prompt_set, jnp.float8_e4m3fn, length), base)}
    for scheme in ("int8", "int4"):
        rates[f"weights {scheme}"] = agreement(dense_greedy(quantize_model(demo, scheme), prompt_set,
                                                            length=length), base)
    print("demo greedy agreement:", rates)
    for name, floor in DEMO_AGREEMENT_FLOORS.items():
        assert rates[name] >= floor, (name, rates[name])
