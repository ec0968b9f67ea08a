"""Parallel layouts on 8 forced host devices, run in a subprocess by tests/test_parallel.py (the device count is
fixed when JAX starts, so the rest of the suite keeps its single device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel_cases.py CASE [CASE ...]

Prints one JSON object: per case, the greedy outputs of a fixed batch of prompts, and for tensor-parallel
engines the placement of every weight and of the KV cache, the collectives in each compiled step and the bytes
the step aliases (the donated cache). Tiny model, tiny bucket ladder, XLA optimisation level 0.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.engine import EngineCore, LLMEngine
from jaxserve.engine.replicas import DataParallelCore, data_parallel_meshes
from jaxserve.models.llama import random_model
from jaxserve.sampling_params import SamplingParams

# heads and KV heads divisible by 8, so every tensor-parallel size splits everything it can
MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=8, num_kv_heads=8, head_dim=16, max_position_embeddings=512,
                    dtype="float32")
ENGINE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=128,
                      decode_buckets=(4,), prefill_token_buckets=(32,), prefill_seq_buckets=(4,),
                      context_buckets=(128,), kv_cache_memory=2**20, xla_optimization_level=0,
                      compilation_cache_dir="")
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 12, list(range(100, 119))]
NEW_TOKENS = 8
COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(-start)?\(")


def model(cfg: ModelConfig = MODEL):
    """Random weights scaled up so greedy choices are far from ties (reduction order differs across layouts)."""
    m = random_model(cfg, jnp.float32, seed=0)
    nnx.update(m, jax.tree.map(lambda w: w * 8 if w.ndim >= 2 and jnp.issubdtype(w.dtype, jnp.floating) else w,
                               nnx.state(m, nnx.Param)))
    return m


def greedy(engine, on_added=lambda: None, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    on_added()
    finals = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()}
    return [finals[str(i)] for i in range(len(prompts))]


def reference(m) -> list[list[int]]:
    """Greedy by full recomputation on one device (no cache, no batching, no mesh)."""
    forward = jax.jit(lambda tokens: m.forward_dense(tokens[None])[0])
    outputs = []
    for prompt in PROMPTS:
        tokens = list(prompt)
        for _ in range(NEW_TOKENS):
            padded = np.zeros(ENGINE.max_model_len, np.int32)
            padded[:len(tokens)] = tokens
            tokens.append(int(jnp.argmax(forward(padded)[len(tokens) - 1])))
        outputs.append(tokens[len(prompt):])
    return outputs


def placement(engine: LLMEngine) -> dict:
    """Mesh-axis spec and device count of every weight and of the KV cache, plus the compiled steps' facts."""
    def describe(x):
        return {"spec": [a for a in x.sharding.spec], "devices": sorted(d.id for d in x.sharding.device_set),
                "shard_shape": list(x.sharding.shard_shape(x.shape))}

    flat = nnx.to_flat_state(engine.core.runner.params)
    weights = {"/".join(map(str, path)): describe(var.get_value()) for path, var in flat}
    steps = {}
    for shape, executable in engine.core.runner.executables.items():
        collectives = Counter(f"{m.group(2)} {m.group(1)}" for m in map(COLLECTIVE.search,
                                                                         executable.as_text().splitlines()) if m)
        steps[str(shape)] = {"collectives": dict(collectives),
                             "alias_bytes": executable.memory_analysis().alias_size_in_bytes}
    return {"weights": weights, "kv": describe(engine.core.runner.kv.k), "steps": steps,
            "kv_cache_bytes": engine.core.kv_plan.cache_bytes, "rules": dict(engine.core.sharder.rules),
            "slots": describe(engine.core.runner.slots.tokens)}


def tensor_parallel(tp: int, cfg: ModelConfig = MODEL, **engine_options) -> dict:
    engine = LLMEngine(model(cfg), ENGINE.replace(tensor_parallel_size=tp, **engine_options), show_progress=False)
    return {"tokens": greedy(engine), **placement(engine)}


def data_parallel(dp: int, tp: int) -> dict:
    config = ENGINE.replace(tensor_parallel_size=tp, data_parallel_size=dp)
    m = model()
    replicas = [EngineCore(m, config, show_progress=False, mesh=mesh) for mesh in data_parallel_meshes(config)]
    core = DataParallelCore(replicas)
    routed = []
    tokens = greedy(LLMEngine.from_core(core),
                    lambda: routed.extend(core.replica_index(str(i)) for i in range(len(PROMPTS))))
    return {"tokens": tokens, "routed_to": routed,
            "replica_devices": [sorted(d.id for d in r.sharder.devices) for r in replicas],
            "weights_on": [sorted(d.id for d in r.runner.params["embed"][...].sharding.device_set)
                           for r in replicas],
            "kv_on": [sorted(d.id for d in r.runner.kv.k.sharding.device_set) for r in replicas]}


def moe_fixture(family: str, tp: int) -> dict:
    """A tiny MoE fixture (tests/fixtures/<family>, converted here) served on `tp` devices: expert parallelism
    where its experts divide over them, else tensor parallelism inside each expert. `expected` is transformers'
    greedy continuation (which the single-device engine reproduces, tests/test_families.py)."""
    from jaxserve.convert import convert
    fixture = Path(__file__).parent / "fixtures" / family
    reference_prompts = json.loads((fixture / "reference.json").read_text())["prompts"]
    model_dir = convert(fixture / "hf", Path(tempfile.mkdtemp()) / family, progress=False)
    engine = LLMEngine.from_model_dir(model_dir, ENGINE.replace(tensor_parallel_size=tp), show_progress=False)
    tokens = greedy(engine, prompts=[p["ids"] for p in reference_prompts])
    return {"tokens": tokens, "expected": [p["continuation"][:NEW_TOKENS] for p in reference_prompts],
            **placement(engine)}


GQA = ModelConfig(**{**MODEL.__dict__, "num_kv_heads": 2})  # 2 KV heads: split on 2 devices, whole on 4
INT8 = ModelConfig(**{**MODEL.__dict__, "quantization": "int8", "lm_head_quantization": "int8"})
# imported formats: int4 with zero points and act-order (GPTQ desc_act), an fp8 LM head
ZP_ACT = ModelConfig(**{**MODEL.__dict__, "quantization": "int4-g32-zp-act", "lm_head_quantization": "fp8"})

CASES = {
    "reference": lambda: {"tokens": reference(model())},
    "tp1": lambda: tensor_parallel(1),
    "tp2": lambda: tensor_parallel(2),
    "tp4": lambda: tensor_parallel(4),
    "tp8": lambda: tensor_parallel(8),
    "dp2": lambda: data_parallel(2, 2),
    "gqa_reference": lambda: {"tokens": reference(model(GQA))},
    "gqa_tp2": lambda: tensor_parallel(2, GQA),
    "gqa_tp4": lambda: tensor_parallel(4, GQA),
    "pallas_tp2": lambda: tensor_parallel(2, attention="pallas"),
    "int8_reference": lambda: {"tokens": reference(model(INT8))},
    "int8_tp2": lambda: tensor_parallel(2, INT8),
    "int8_pallas_tp2": lambda: tensor_parallel(2, INT8, matmul="pallas"),
    "zp_act_reference": lambda: {"tokens": reference(model(ZP_ACT))},
    "zp_act_tp2": lambda: tensor_parallel(2, ZP_ACT),
    "zp_act_pallas_tp2": lambda: tensor_parallel(2, ZP_ACT, matmul="pallas"),
    "mixtral_tp8": lambda: moe_fixture("mixtral", 8),  # 4 experts on 8 devices: split inside the experts
    "qwen3moe_tp8": lambda: moe_fixture("qwen3-moe", 8),  # 8 experts on 8 devices: one expert per device
    "qwen3moe_tp2": lambda: moe_fixture("qwen3-moe", 2),  # 4 experts per device, attention heads split too
}


def main(names: list[str]) -> None:
    if jax.device_count() != 8:
        sys.exit(f"needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), has {jax.device_count()}")
    results = {}
    for name in names:
        start = time.perf_counter()
        results[name] = {**CASES[name](), "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main(sys.argv[1:])
