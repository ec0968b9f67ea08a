"""The families beyond the Llama layout and the long-context rope scalings: Phi-3 (fused tensors, LongRoPE, partial
rotary), Gemma 2 and 3 (soft-capping, alternating sliding/global layers with their own ropes), Mixtral and
Qwen3-MoE (routed experts, grouped matmuls), YaRN and dynamic NTK.

test_parity.py already holds every fixture family to transformers (prefill, decode, forward_dense, bfloat16).
This file checks what parity alone does not show: the config parsing, the rope tables against transformers' own,
the tokenizers and chat templates, and the engine (batched, paged, chunked prefill, prefix-cache hits) on the XLA,
C++ and Pallas (interpret mode) attention paths, each giving transformers' greedy tokens.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import HF_FIXTURES
from jaxserve import cpu
from jaxserve.checkpoint import load_model
from jaxserve.config import ConfigError, EngineConfig, ModelConfig, model_config_from_hf
from jaxserve.engine.engine import LLMEngine
from jaxserve.models import moe, rope
from jaxserve.observability.cost import ModelCost
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import load_tokenizer

FAMILIES = ["qwen2-yarn", "llama-dynamic", "phi3", "gemma2", "gemma3", "mixtral", "qwen3-moe"]
PINNED_ROPE = ["llama-dynamic", "phi3"]  # transformers' frequencies were pinned at jaxserve's length (fixture doc)
NEW_TOKENS = 12
# max_num_batched_tokens 32 < the longest prompt (38 tokens): prompts arrive in chunks.
ENGINE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=16, max_model_len=128,
                      decode_buckets=(4,), prefill_token_buckets=(32,), prefill_seq_buckets=(4,),
                      context_buckets=(128,), kv_cache_memory=2**22, xla_optimization_level=0,
                      compilation_cache_dir="")


def reference(family: str) -> dict:
    return json.loads((HF_FIXTURES / family / "reference.json").read_text())


def hf_config(family: str) -> dict:
    return json.loads((HF_FIXTURES / family / "hf" / "config.json").read_text())


def reference_arrays(family: str) -> dict[str, np.ndarray]:
    with np.load(HF_FIXTURES / family / "reference_logits.npz") as npz:
        return {k: npz[k] for k in npz.files}


# ---------------------------------------------------------------------------------------------- config

def test_each_family_config_reads_what_transformers_reads():
    phi3 = model_config_from_hf(hf_config("phi3"))
    assert (phi3.family, phi3.rope.type, phi3.rope.partial_rotary_factor) == ("phi3", "longrope", 0.75)  # from "su"
    assert (phi3.rope.original_max_position_embeddings, phi3.max_position_embeddings) == (64, 256)
    gemma2 = model_config_from_hf(hf_config("gemma2"))
    assert gemma2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma2.layer_windows() == (16, None, 16)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.attention_scale) == (
        8.0, 12.0, 24 ** -0.5)
    assert gemma2.norm_offset and gemma2.scale_embeddings and gemma2.sandwich_norms and gemma2.tie_word_embeddings
    assert gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = model_config_from_hf(hf_config("gemma3"))
    assert (gemma3.rope.type, gemma3.rope.factor, gemma3.rope.theta) == ("linear", 8.0, 1e6)
    assert (gemma3.local_rope.type, gemma3.local_rope.theta, gemma3.qk_norm) == ("default", 1e4, True)
    # vLLM's rule: linear, dynamic and yarn scalings extend the served length by their factor (yarn: of the
    # original context); llama3 and longrope configs already state the extended length; Gemma 3's is scaled.
    assert model_config_from_hf(hf_config("qwen2-yarn")).max_position_embeddings == 4 * 32
    assert model_config_from_hf(hf_config("llama-dynamic")).max_position_embeddings == 4 * 32
    assert gemma3.max_position_embeddings == 256
    mixtral, qwen3_moe = model_config_from_hf(hf_config("mixtral")), model_config_from_hf(hf_config("qwen3-moe"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (4, 2, True)
    assert (qwen3_moe.num_experts, qwen3_moe.intermediate_size, qwen3_moe.norm_topk_prob) == (8, 48, False)
    assert qwen3_moe.qk_norm
    # active parameters: the router and 2 of the experts per layer
    assert mixtral.num_params() - mixtral.num_params(active=True) == 2 * 2 * 3 * 64 * 128


def test_moe_layouts_jaxserve_cannot_serve_are_refused():
    hf = hf_config("qwen3-moe")
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        model_config_from_hf({**hf, "mlp_only_layers": [0]})
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        model_config_from_hf({**hf, "decoder_sparse_step": 2})


def test_gemma_layer_types_default_to_the_family_pattern():
    hf = {k: v for k, v in hf_config("gemma3").items() if k != "layer_types"}
    assert model_config_from_hf({**hf, "num_hidden_layers": 7}).layer_types == (
        ("sliding_attention",) * 5 + ("full_attention",) + ("sliding_attention",))
    hf2 = {k: v for k, v in hf_config("gemma2").items() if k != "layer_types"}
    assert model_config_from_hf(hf2).layer_types == ("sliding_attention", "full_attention", "sliding_attention")


def test_old_and_new_gemma3_rope_forms_agree():
    hf = hf_config("gemma3")
    params = hf["rope_parameters"]
    old = {k: v for k, v in hf.items() if k != "rope_parameters"}
    old.update(rope_theta=params["full_attention"]["rope_theta"], rope_scaling={"rope_type": "linear", "factor": 8.0},
               rope_local_base_freq=params["sliding_attention"]["rope_theta"])
    assert model_config_from_hf(old) == model_config_from_hf(hf)


@pytest.mark.parametrize("rope_scaling,message", [
    ({"rope_type": "mrope", "factor": 2.0}, "rope scaling type 'mrope' is not supported; jaxserve supports"),
    ({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "original_max_position_embeddings": 16},
     "longrope short_factor must have 8 entries"),
])
def test_unusable_rope_configs_are_refused_with_a_reason(rope_scaling, message):
    hf = {**hf_config("llama-dynamic"), "rope_parameters": None, "rope_scaling": rope_scaling}
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(hf)


def test_a_checkpoint_config_round_trips_through_json():
    for family in FAMILIES:
        cfg = model_config_from_hf(hf_config(family))
        assert ModelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
        hash(cfg)  # a static attribute of the model: jit needs it hashable


# ---------------------------------------------------------------------------------------------- rope

@pytest.mark.parametrize("family", PINNED_ROPE)
def test_rope_tables_match_transformers(family):
    cfg, arrays, record = model_config_from_hf(hf_config(family)), reference_arrays(family), reference(family)
    inv_freq, attention = rope.rope_frequencies(cfg.rope, cfg.head_dim)
    np.testing.assert_allclose(inv_freq, arrays["rope_inv_freq"], rtol=1e-6)
    assert attention == pytest.approx(record["pinned_rope"]["attention_factor"], rel=1e-6)


def test_longrope_uses_short_factors_up_to_the_original_context():
    cfg, arrays, record = model_config_from_hf(hf_config("phi3")), reference_arrays("phi3"), reference("phi3")
    short = cfg.for_context(cfg.rope.original_max_position_embeddings)
    inv_freq, attention = rope.rope_frequencies(short.rope, cfg.head_dim)
    np.testing.assert_allclose(inv_freq, arrays["rope_inv_freq_short"], rtol=1e-6)
    assert attention == pytest.approx(record["pinned_rope"]["attention_factor_short"], rel=1e-6)
    long_freq, _ = rope.rope_frequencies(cfg.for_context(65).rope, cfg.head_dim)
    assert not np.allclose(long_freq, inv_freq)
    assert len(inv_freq) == rope.rotary_dim(cfg.rope, cfg.head_dim) // 2 == 6  # partial rotary: 12 of 16 dims


def test_partial_rotary_passes_the_other_dims_through():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 2, 16)), jnp.float32)
    cos, sin = rope.rope_cos_sin(jnp.arange(5), np.full(6, 0.3, np.float32), 1.0, jnp.float32)
    out = rope.apply_rope(x, cos, sin)
    np.testing.assert_array_equal(out[..., 12:], x[..., 12:])
    assert not np.allclose(out[1:, :, :12], x[1:, :, :12])


# ---------------------------------------------------------------------------------------------- model

def test_gemma3_sliding_layers_attend_only_inside_their_window(converted):
    """The longest prompt (38 tokens) runs past the 16-token window: widening the window beyond the prompt must
    keep the first 16 positions' logits and change the later ones, so the windows are applied (and parity with
    transformers shows they are applied right)."""
    model = load_model(converted("gemma3"))
    ids = reference("gemma3")["prompts"][3]["ids"]
    assert len(ids) > model.cfg.sliding_window
    tokens = jnp.asarray([ids])
    graphdef, state = nnx.split(model)
    windowed = np.asarray(nnx.merge(graphdef, state).forward_dense(tokens))
    model.cfg = dataclasses.replace(model.cfg, sliding_window=4096)
    graphdef_global, _ = nnx.split(model)
    unwindowed = np.asarray(nnx.merge(graphdef_global, state).forward_dense(tokens))
    np.testing.assert_allclose(windowed[0, :16], unwindowed[0, :16], rtol=1e-5, atol=1e-5)  # inside the window
    assert np.abs(windowed[0, 16:] - unwindowed[0, 16:]).max() > 1e-3


def test_gemma2_logits_are_soft_capped(converted):
    model = load_model(converted("gemma2"))
    logits = np.asarray(model.forward_dense(jnp.asarray([reference("gemma2")["prompts"][3]["ids"]])))
    assert np.abs(logits).max() < model.cfg.final_logit_softcapping


def _moe_problem(seed: int, tokens: int = 24, experts: int = 8, hidden: int = 32, inner: int = 48):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32)  # noqa: E731
    return (normal(tokens, hidden), normal(hidden, experts), normal(experts, hidden, inner),
            normal(experts, hidden, inner), normal(experts, inner, hidden))


@pytest.mark.parametrize("grouped", ["ragged_dot", "tiled"])
@pytest.mark.parametrize("routing", ["random", "two_experts_take_all", "one_expert_takes_all"])
@pytest.mark.parametrize("normalize", [True, False])
def test_grouped_experts_match_every_expert_on_every_token(grouped, routing, normalize):
    """Tokens grouped by expert (either grouped matmul) equal the dense mixture, also when most experts get no
    token and one or two get every token (a router biased to them)."""
    h, router, we_gate, we_up, we_down = _moe_problem(0)
    top_k = 1 if routing == "one_expert_takes_all" else 2
    if routing != "random":
        h = h.at[:, 0].set(1.0)  # a constant feature, which the router weighs heavily for experts 0..k-1
        router = router.at[0, :top_k].add(50.0)
        experts, _ = moe.route(h, router, top_k, normalize)
        assert set(np.asarray(experts).ravel().tolist()) == set(range(top_k))
    kw = dict(top_k=top_k, normalize=normalize, activation=jax.nn.silu)
    matmul = {"ragged_dot": moe.ragged_dot, "tiled": moe.tiled_grouped_matmul}[grouped]
    out = jax.jit(lambda *a: moe.routed_mlp(*a, **kw, grouped_matmul=matmul))(h, router, we_gate, we_up, we_down)
    dense = moe.dense_reference(h, router, we_gate, we_up, we_down, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300])
def test_tiled_grouped_matmul_equals_ragged_dot(rows):
    """Random group sizes with empty groups and rows left over past the last group (zeros there)."""
    rng = np.random.default_rng(rows)
    groups = 6
    sizes = rng.multinomial(rng.integers(0, rows + 1), rng.dirichlet(np.ones(groups) * 0.3))
    sizes[rng.integers(groups)] = 0
    x = jnp.asarray(rng.standard_normal((rows, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((groups, 24, 40)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(np.asarray(jax.jit(moe.tiled_grouped_matmul)(x, w, sizes)),
                               np.asarray(moe.ragged_dot(x, w, sizes)), rtol=1e-5, atol=1e-5)


def test_moe_cost_counts_routed_flops_and_the_experts_a_step_reads():
    """FLOPs: the router and the k routed experts per token; bytes: every other weight once per step, the experts
    at the step's coverage 1 - (1 - k/X)^tokens."""
    cfg = model_config_from_hf(hf_config("mixtral"))  # 2 layers, 4 experts of 64 x 128, top 2, untied head
    cost = ModelCost.of(cfg, "float32", kv_bytes_per_token=0)
    experts = 2 * 4 * 3 * 64 * 128 * 4
    assert cost.expert_bytes == experts
    attention = 64 * 16 * (2 * 4 + 2 * 2)
    assert cost.matmul_params == 2 * (attention + 64 * 4 + 2 * 3 * 64 * 128)
    one_token = cost.work(steps=1, tokens=1, seqs=1, context_tokens=0, attended_pairs=0)
    assert one_token.weight_bytes == pytest.approx(cost.step_weight_bytes + 64 * 4 + experts * 0.5)
    big_batch = cost.work(steps=1, tokens=64, seqs=64, context_tokens=0, attended_pairs=0)
    assert big_batch.weight_bytes == pytest.approx(cost.step_weight_bytes + 64 * 64 * 4 + experts, rel=1e-9)
    assert cost.work(steps=0, tokens=10, seqs=1, context_tokens=0, attended_pairs=0).weight_bytes == 10 * 64 * 4


def test_estimate_reports_active_parameters_and_counts_all_experts_as_weights(capsys):
    from jaxserve import cli
    from jaxserve.estimate import weight_arrays
    assert cli.main(["estimate", "--model", str(HF_FIXTURES / "qwen3-moe" / "hf"), "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    cfg = model_config_from_hf(hf_config("qwen3-moe"))
    assert f"({cfg.num_params(active=True) / 1e9:.3g}B active: 2 of 8 experts per token)" in out
    stored = sum(int(np.prod(shape)) for _, shape, _ in weight_arrays(cfg, "float32"))
    assert stored == cfg.num_params()  # every expert is a stored weight


# ---------------------------------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_and_chat_template_match_transformers(converted, family):
    ref = reference(family)
    cfg = ModelConfig.load(converted(family))
    tok = load_tokenizer(converted(family), model_type=cfg.family)
    for prompt in ref["prompts"]:
        assert tok.encode(prompt["text"]) == prompt["ids"], prompt["text"]
    chat = ref["chat"]
    assert tok.apply_chat_template(chat["messages"], add_generation_prompt=True) == chat["text"]
    assert tok.encode_chat(chat["messages"]) == chat["ids"]


# ---------------------------------------------------------------------------------------------- engine

def _greedy_through_engine(model_dir, attention: str, prompts: list[list[int]]):
    """Every prompt twice (the second round hits the prefix cache), 4 at a time, chunked by the 32-token budget."""
    engine = LLMEngine.from_model_dir(model_dir, ENGINE.replace(attention=attention), show_progress=False)
    assert engine.core.kernels.attention_name == attention
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    rounds = []
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", prompt, params)
        finals = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()}
        rounds.append([finals[f"{round_}-{i}"] for i in range(len(prompts))])
    hits = engine.core.scheduler.allocator.stats.hits
    engine.core.scheduler.check_invariants()
    return rounds, hits


# Every family on the XLA and C++ paths; the Pallas kernels (interpret mode, slow on a CPU) on the families that
# exercise something new in them: soft-capping with per-layer windows, per-layer ropes, partial rotary, MoE.
ENGINE_CASES = ([(family, attention) for family in FAMILIES for attention in ("xla", "cpu")]
                + [(family, "pallas") for family in ("gemma2", "qwen3-moe")]
                + [pytest.param(family, "pallas", marks=pytest.mark.slow) for family in ("gemma3", "phi3")])


@pytest.mark.parametrize("family,attention", ENGINE_CASES)
def test_engine_greedy_matches_transformers(converted, family, attention):
    if attention == "cpu" and (jax.default_backend() != "cpu" or not cpu.available()):
        pytest.skip("the C++ kernel needs the CPU backend and a compiler")
    ref = reference(family)
    prompts = [p["ids"] for p in ref["prompts"]]
    (first, second), hits = _greedy_through_engine(converted(family), attention, prompts)
    expected = [p["continuation"][:NEW_TOKENS] for p in ref["prompts"]]
    assert first == expected
    assert second == expected
    assert hits >= ENGINE.page_size, "the second round should reuse cached prompt pages"
