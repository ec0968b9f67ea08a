"""`jaxserve estimate` against what the engine actually allocates, and the command itself.

The engine sizes its KV cache from the free memory it measures after loading the weights and the slot state (on a
GPU: memory_stats' bytes_limit - bytes_in_use), minus the temporaries of its largest step shapes, which it compiles
and measures first (memory_analysis). The CPU backend reports no memory stats, so these tests give the engine an
accelerator-like allocator pool: `pool` bytes, of which every jax array created since the test began is in use
(what XLA's GPU allocator counts). The estimate gets the same pool from the config alone (pool fraction 1) and
measures the same shapes from abstract weights (measure=True); both then go through plan_kv_cache. Checked: the
weights as stored (quantized values, scales, float embeddings), the temporaries, KV bytes per token, pages, and that
weights + slot state + temporaries + KV cache fit the pool. The remaining step shapes are not compiled (compile_all
is stubbed out): they do not change the plan.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import cli
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import placement
from jaxserve.engine.placement import engine_mesh, model_sharder
from jaxserve.engine.engine import LLMEngine, resolve_dtype
from jaxserve.engine.runner import ModelRunner
from jaxserve.estimate import estimate, load_model_config, report
from jaxserve.models.llama import Llama, abstract_model
from jaxserve.observability.gpus import GPUS, GiB, gpu_for_device_kind
from jaxserve.quant.memory import weight_bytes

DEMO = Path(__file__).resolve().parents[1] / "checkpoints" / "demo"
ENGINE = EngineConfig(max_num_seqs=64, max_num_batched_tokens=64, page_size=16, max_model_len=256,
                      decode_buckets=(64,), prefill_token_buckets=(64,), prefill_seq_buckets=(64,),
                      xla_optimization_level=0, compilation_cache_dir="")
MEDIUM = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=384, intermediate_size=1024,
                     num_layers=4, num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=2048,
                     dtype="float32")
# The bundled demo model's configuration (checkpoints/README.md): tied embeddings, bfloat16 as stored
DEMO_SHAPE = ModelConfig(architecture="LlamaForCausalLM", vocab_size=4096, hidden_size=256, intermediate_size=704,
                         num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, max_position_embeddings=256,
                         tie_word_embeddings=True, dtype="bfloat16")


@pytest.fixture
def accelerator_pool(monkeypatch):
    """pool(bytes): from now on the engine measures `bytes` minus every jax array created since as free memory."""
    monkeypatch.setattr(ModelRunner, "compile_all", lambda self, progress=None, workers=None: 0.0)

    def pool(size: int) -> None:
        gc.collect()
        baseline = live_bytes()
        monkeypatch.setattr(placement, "free_device_memory", lambda device=None: size - (live_bytes() - baseline))

    return pool


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def pool_for(cfg: ModelConfig, engine: EngineConfig, dtype: str) -> tuple[int, int]:
    """A pool whose KV budget holds about half of what max_num_seqs full sequences want (so the budget, not the
    max_num_seqs cap, decides), and the temporaries the estimate measured (compiled once per case)."""
    roomy = estimate(cfg, engine, memory_bytes=64 * GiB, weight_dtype=dtype, pool_fraction=1.0, measure=True).memory
    wanted = roomy.plan.wanted_pages * roomy.plan.bytes_per_page
    reserve = roomy.temporaries + roomy.plan.margin
    return roomy.weights + roomy.slots + int((0.5 * wanted + reserve) / engine.kv_cache_fraction), roomy.temporaries


def check_agreement(engine: LLMEngine, cfg: ModelConfig, config: EngineConfig, pool: int, temporaries: int) -> None:
    dtype = jnp.dtype(engine.core.runner.params["embed"][...].dtype).name
    predicted = estimate(cfg, config, memory_bytes=pool, weight_dtype=dtype, pool_fraction=1.0,
                         temporaries=temporaries).memory
    allocated_kv = sum(x.nbytes for x in jax.tree.leaves(engine.core.runner.kv))
    slots = sum(x.nbytes for x in jax.tree.leaves(engine.core.runner.slots))
    plan = engine.core.kv_plan
    print(f"{cfg.architecture} {cfg.quantization or dtype}, KV {engine.core.kv_dtype.name}: estimate "
          f"{predicted.kv_tokens} tokens / {predicted.kv_cache} B, temporaries {predicted.temporaries} B; engine "
          f"{plan.max_tokens} tokens / {allocated_kv} B, temporaries {plan.temporaries} B (weights: estimate "
          f"{predicted.weights} B, engine {engine.core.weight_bytes} B)")
    assert plan.num_pages < plan.wanted_pages  # the budget decided, not the cap
    assert predicted.weights == engine.core.weight_bytes and predicted.slots == slots
    assert abs(predicted.temporaries - plan.temporaries) <= 0.05 * plan.temporaries
    assert abs(predicted.kv_tokens - plan.max_tokens) <= 0.05 * plan.max_tokens
    assert abs(predicted.kv_cache - allocated_kv) <= 0.05 * allocated_kv
    assert engine.core.weight_bytes + slots + plan.temporaries + plan.margin + allocated_kv <= pool
    assert engine.core.temporaries <= plan.temporaries + plan.margin  # every compiled shape fits what was reserved


@pytest.mark.parametrize("family, stored", [("llama3.1", "float32"), ("llama3.1", "bfloat16"),
                                            ("qwen2", "float32"), ("qwen3", "float32"), ("mistral", "float32")])
def test_estimate_agrees_with_the_engine_on_fixture_checkpoints(converted, accelerator_pool, family, stored):
    model_dir = converted(family, stored)
    cfg = load_model_config(model_dir)
    pool, temporaries = pool_for(cfg, ENGINE, resolve_dtype(ENGINE.dtype, cfg.dtype))
    accelerator_pool(pool)
    engine = LLMEngine.from_model_dir(model_dir, ENGINE, show_progress=False)
    check_agreement(engine, cfg, ENGINE, pool, temporaries)


@pytest.mark.parametrize("base, quantization, kv_dtype", [
    ("medium", None, "auto"), ("medium", None, "int8"), ("medium", "int8", "auto"), ("medium", "int4", "fp8"),
    ("demo", None, "auto")])
def test_estimate_agrees_with_the_engine_on_models_built_from_a_config(accelerator_pool, base, quantization,
                                                                        kv_dtype):
    # built in float32 as a float32 checkpoint would load (a bfloat16 one keeps what the CPU kernel reads bfloat16)
    cfg = dataclasses.replace({"medium": MEDIUM, "demo": DEMO_SHAPE}[base], quantization=quantization, dtype="float32")
    config = ENGINE.replace(kv_cache_dtype=kv_dtype)
    pool, temporaries = pool_for(cfg, config, "float32")
    accelerator_pool(pool)
    engine = LLMEngine(model_on_devices(cfg, config), config, show_progress=False)
    check_agreement(engine, cfg, config, pool, temporaries)


def model_on_devices(cfg: ModelConfig, config: EngineConfig) -> Llama:
    """The model of `cfg` with zero weights (values do not matter here; random ones take a compile per config),
    made straight on the engine's devices as the checkpoint loader restores them."""
    sharder = model_sharder(cfg, engine_mesh(config), jnp.float32)
    graphdef, state = nnx.split(abstract_model(cfg, jnp.float32))

    def zeros(var: nnx.Variable) -> nnx.Variable:
        value = var.get_value()
        return var.replace(jax.device_put(np.zeros(value.shape, value.dtype),
                                          sharder.sharding(var.get_metadata().get("axes", ()))))

    return nnx.merge(graphdef, jax.tree.map(zeros, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


@pytest.mark.skipif(not (DEMO / "jaxserve.json").exists(), reason="checkpoints/demo is not trained yet "
                    "(checkpoints/README.md)")
def test_estimate_agrees_with_the_engine_on_the_demo_model(accelerator_pool):
    cfg = load_model_config(DEMO)
    config = ENGINE.replace(max_model_len=None)
    pool, temporaries = pool_for(cfg, config, resolve_dtype(config.dtype, cfg.dtype))
    accelerator_pool(pool)
    engine = LLMEngine.from_model_dir(DEMO, config, show_progress=False)
    check_agreement(engine, cfg, config, pool, temporaries)


def test_weights_estimate_equals_the_quantization_byte_accounting():
    for quantization in (None, "int8", "int4"):
        for dtype in ("float32", "bfloat16"):
            cfg = dataclasses.replace(MEDIUM, quantization=quantization)
            predicted = estimate(cfg, ENGINE, memory_bytes=GiB, weight_dtype=dtype).memory.weights
            assert predicted == weight_bytes(cfg, dtype), (quantization, dtype)


def test_tensor_parallel_divides_what_the_sharding_rules_split():
    cfg = MEDIUM  # 6 heads, 2 KV heads
    one = estimate(cfg, ENGINE, memory_bytes=GiB, weight_dtype="float32")
    two = estimate(cfg, ENGINE.replace(tensor_parallel_size=2), memory_bytes=GiB, weight_dtype="float32")
    four = estimate(cfg, ENGINE.replace(tensor_parallel_size=4), memory_bytes=GiB, weight_dtype="float32")
    assert two.memory.kv_bytes_per_token == one.memory.kv_bytes_per_token // 2
    assert two.memory.weights < 0.6 * one.memory.weights
    # 2 KV heads and 6 heads do not divide by 4: the heads and the KV cache stay whole on every device
    assert four.memory.kv_bytes_per_token == one.memory.kv_bytes_per_token
    assert one.memory.weights / 4 < four.memory.weights < two.memory.weights  # MLP and vocabulary still split


def test_llama_3_8b_on_an_h100_matches_the_hand_arithmetic(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B))
    cfg = load_model_config(config)
    result = estimate(cfg, EngineConfig(max_model_len=8192), memory_bytes=GPUS["h100"].memory_bytes,
                      gpu=GPUS["h100"])
    m = result.memory
    assert result.params == 8_030_261_248
    assert m.weights == 8_030_261_248 * 2  # bfloat16, untied LM head
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert m.pool == int(80 * GiB * 0.75) and m.free == m.pool - m.weights - m.slots
    assert m.slots == 65 * 8193 * 4 + m.slots % (65 * 8193 * 4)  # the token history dominates the slot state
    assert m.kv_budget == int(m.free * 0.9) - m.temporaries - m.plan.margin
    assert m.plan.bytes_per_page == 16 * 128 * 1024
    assert result.concurrent_sequences == (m.kv_budget // m.plan.bytes_per_page - 1) // 512  # 40
    floors = result.floors()
    # decode at batch 1 reads ~15 GB of weights (the embedding table is only gathered) at 3.35 TB/s: ~4.5 ms
    assert 4.0e-3 < floors["weights_read_s"] < 5.0e-3
    assert floors["decode_batch1_s"] > floors["weights_read_s"]
    assert result.rule_of_thumb == pytest.approx(8_030_261_248 * 2 * 1.2)


def test_cli_prints_a_report_and_json(capsys):
    fixture = Path(__file__).parent / "fixtures" / "llama3.1" / "hf"
    assert cli.main(["estimate", "--model", str(fixture), "--gpu", "h200"]) == 0
    text = capsys.readouterr().out
    for needle in ("memory per device", "KV cache", "concurrent sequences", "decode, batch 1", "prefill",
                   "rule of thumb", "h200"):
        assert needle in text, needle
    assert cli.main(["estimate", "--model", str(fixture), "--memory-gb", "1", "--quantize", "int8",
                     "--kv-cache-dtype", "int8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["floors"] is None and data["kv_tokens"] > 0 and data["kv_dtype"] == "int8"


def test_cli_says_when_the_model_does_not_fit(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B))
    assert cli.main(["estimate", "--model", str(config), "--gpu", "l4", "--max-model-len", "65536"]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_gpu_table_has_the_named_parts_with_plausible_figures():
    for name in ("h100", "h200", "a100", "l4"):
        spec = GPUS[name]
        assert 20 * GiB <= spec.memory_bytes <= 200 * GiB
        assert 2e11 < spec.bandwidth < 1e13 and 1e14 < spec.bf16_flops < 3e15
    assert gpu_for_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert gpu_for_device_kind("NVIDIA A100-SXM4-80GB").name == "a100"
    assert gpu_for_device_kind("cpu") is None


LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "hidden_act": "silu", "tie_word_embeddings": False, "rms_norm_eps": 1e-05}


def test_a_bfloat16_checkpoint_run_in_float32_here_counts_its_kept_projections_as_stored():
    """On this machine (CPU kernels) the engine keeps a bfloat16 checkpoint's projections bfloat16 under float32
    arithmetic (kept_in_storage); the estimate counts them so and says it. For a GPU target nothing is kept."""
    cfg = dataclasses.replace(MEDIUM, dtype="bfloat16")
    here = estimate(cfg, ENGINE.replace(matmul="cpu"), memory_bytes=GiB, weight_dtype="float32")
    gpu = estimate(cfg, ENGINE.replace(matmul="cpu"), memory_bytes=GiB, gpu=GPUS["h100"], weight_dtype="float32")
    projections = {f"layers/{name}" for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    assert set(here.kept) == projections | ({"lm_head"} if not cfg.tie_word_embeddings else set())
    assert here.memory.weights == weight_bytes(cfg, "float32", dict.fromkeys(here.kept, "bfloat16"))
    assert here.memory.weights < gpu.memory.weights == weight_bytes(cfg, "float32")
    assert "weights float32 (projections stored bfloat16)" in report(here).splitlines()[0]
    assert gpu.kept == () and "projections stored" not in report(gpu)
