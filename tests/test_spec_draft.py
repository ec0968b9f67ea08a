"""Speculative decoding with a draft model (jaxserve.spec.draft): greedy output equals greedy output without
speculation, token for token (a random model against its dense reference, the parity fixture families, the demo
model with its bundled draft), with staggered arrivals, preemption and prefix hits; random aborts free every
page; a draft that does not fit the target is refused with a sentence; sampled outputs keep the target's
distribution through the whole engine (chi-square over 20,000 seeded samples with a bad draft), and the same test
fails when the acceptance rule is broken on purpose."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.checkpoint import load_model
from jaxserve.config import ConfigError, EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.models.llama import Llama, random_model
from jaxserve.quant.memory import kv_bytes_per_token
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec.draft import check_draft_tokenizer
from test_engine import ENGINE, MODEL, greedy, mixed_prompts, model, reference, run_staggered  # noqa: F401
from test_spec_decode import (DEMO, DEMO_TEXTS, FAMILIES, FIXTURE_ENGINE, FIXTURES, mixed_traffic_never_compiles,
                              outputs, preemption_and_prefix_hits_keep_greedy_output, random_aborts_free_every_page,
                              repetitive_prompts, seeded_sampling_ignores_batch_composition)

DEMO_DRAFT = DEMO.parent / "demo-draft"
DRAFT_ENGINE = ENGINE.replace(prefill_token_buckets=(64,), context_buckets=(384,))  # 6 shapes to compile, not 24


def with_draft(config: EngineConfig, k: int = 3, **changes) -> EngineConfig:
    return config.replace(**{"speculative_method": "draft", "num_speculative_tokens": k,
                             "speculative_model": "(in memory)", "speculative_disable_batch_size": None, **changes})


def first_layers(target: Llama, num_layers: int = 1) -> Llama:
    """A draft made of the target's first layers, embeddings and head: often right, often wrong, so verify
    steps both accept and reject."""
    cfg = dataclasses.replace(target.cfg, num_layers=num_layers,
                              layer_types=target.cfg.layer_types[:num_layers] if target.cfg.layer_types else None)
    draft = random_model(cfg, target.dtype, seed=1)
    ours = nnx.to_pure_dict(nnx.state(target, nnx.Param))
    theirs = nnx.to_pure_dict(nnx.state(draft, nnx.Param))

    def take(path, mine, want):
        stacked = any(getattr(key, "key", None) == "layers" for key in path)
        return mine[:num_layers] if stacked and mine.shape[0] == target.cfg.num_layers else mine

    nnx.update(draft, jax.tree_util.tree_map_with_path(take, ours, theirs))
    return draft


@pytest.fixture(scope="module")
def draft(model):
    return first_layers(model)


@pytest.fixture(scope="module")
def draft_engine(model, draft):
    return LLMEngine(model, with_draft(DRAFT_ENGINE, 3), show_progress=False, draft=draft)


def check_against_reference(engine, reference, requests):
    finals = run_staggered(engine, requests, per_step=2, on_step=engine.core.scheduler.check_invariants)
    for request_id, prompt, params in requests:
        assert finals[request_id].outputs[0].token_ids == reference(prompt, params.max_tokens), request_id
    spec = engine.core.stats_snapshot().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # both acceptance and rejection happened
    assert engine.core.scheduler.allocator.num_used_pages == 0


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(5, marks=pytest.mark.slow)])
def test_draft_greedy_equals_the_dense_reference(model, draft, reference, draft_engine, k):
    engine = draft_engine if k == 3 else LLMEngine(model, with_draft(DRAFT_ENGINE, k), show_progress=False, draft=draft)
    prompts = repetitive_prompts(0, 6) + mixed_prompts(0, 6, 200)
    check_against_reference(engine, reference, [(f"s{i}", p, greedy(8 + 4 * (i % 6))) for i, p in enumerate(prompts)])


def test_a_perfect_draft_is_accepted_whole(model, reference):
    """The target as its own draft: every proposal accepted, so the draft's cache must hold exactly the target's
    tokens after every verify step (the bonus token's K/V included)."""
    engine = LLMEngine(model, with_draft(DRAFT_ENGINE, 2, max_num_seqs=2, decode_buckets=(1, 2)),
                       show_progress=False, draft=model)
    prompts = mixed_prompts(5, 3, 120)
    requests = [(f"w{i}", p, greedy(21)) for i, p in enumerate(prompts)]
    finals = run_staggered(engine, requests, per_step=1)
    for request_id, prompt, params in requests:
        assert finals[request_id].outputs[0].token_ids == reference(prompt, 21), request_id
    spec = engine.core.stats_snapshot().spec_decode
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0


@pytest.mark.slow
def test_draft_greedy_with_preemption_and_prefix_hits(model, draft, reference):
    small = with_draft(ENGINE, 3, kv_cache_memory=60 * 8 * (2 * 2 * 2 * 16 + 2 * 1 * 2 * 16) * 4)  # 60 pages
    engine = LLMEngine(model, small, show_progress=False, draft=draft)
    assert engine.core.kv_plan.num_pages == 60
    preemption_and_prefix_hits_keep_greedy_output(engine, reference)


def test_random_aborts_with_a_draft_free_every_page(draft_engine):
    random_aborts_free_every_page(draft_engine, seed=2)


def test_seeded_sampling_with_a_draft_ignores_batch_composition(draft_engine):
    seeded_sampling_ignores_batch_composition(draft_engine)


def test_mixed_traffic_with_a_draft_never_compiles(draft_engine):
    mixed_traffic_never_compiles(draft_engine)


def test_the_memory_plan_counts_the_drafts_pages(draft_engine, draft):
    plan, target = draft_engine.core.kv_plan, draft_engine.model_config
    assert plan.bytes_per_page == (kv_bytes_per_token(target, "auto", "float32")
                                   + kv_bytes_per_token(draft.cfg, "auto", "float32")) * plan.page_size
    runner = draft_engine.core.runner
    assert runner.draft_kv.k.shape[2] == runner.kv.k.shape[2] == plan.num_pages


def test_a_draft_that_does_not_fit_is_refused(model):
    other_vocab = random_model(dataclasses.replace(MODEL, vocab_size=256, num_layers=1), jnp.float32)
    with pytest.raises(ConfigError, match="vocabulary of 256 tokens and the target 512"):
        LLMEngine(model, with_draft(ENGINE), show_progress=False, draft=other_vocab)
    short = random_model(dataclasses.replace(MODEL, max_position_embeddings=128, num_layers=1), jnp.float32)
    with pytest.raises(ConfigError, match="fewer than max_model_len 384"):
        LLMEngine(model, with_draft(ENGINE), show_progress=False, draft=short)
    with pytest.raises(ConfigError, match="needs --speculative-model"):
        LLMEngine(model, ENGINE.replace(speculative_method="draft"), show_progress=False)
    with pytest.raises(ConfigError, match="not a jaxserve checkpoint"):
        LLMEngine(model, with_draft(ENGINE).replace(speculative_model="/nonexistent/draft"), show_progress=False)
    with pytest.raises(ConfigError, match="one device"):
        LLMEngine(model, with_draft(ENGINE, tensor_parallel_size=2), show_progress=False)


def fake_tokenizer(vocab: dict[str, int], **changes):
    fields = dict(vocab_size=len(vocab), bos_token_id=1, eos_token_ids=(2,), pad_token_id=None, unk_token_id=0,
                  all_special_ids=(0, 1, 2))
    return SimpleNamespace(backend=SimpleNamespace(get_vocab=lambda: dict(vocab)), **{**fields, **changes})


def test_a_draft_with_another_tokenizer_is_refused():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}
    target = fake_tokenizer(vocab)
    check_draft_tokenizer(fake_tokenizer(vocab), target, "the draft")  # the same: no error
    with pytest.raises(ConfigError, match="eos_token_ids: \\(3,\\) vs \\(2,\\)"):
        check_draft_tokenizer(fake_tokenizer(vocab, eos_token_ids=(3,)), target, "the draft")
    with pytest.raises(ConfigError, match="'a' is id 4 in the draft and 3 in the target"):
        check_draft_tokenizer(fake_tokenizer({**vocab, "a": 4, "b": 3}), target, "the draft")


# ---- real checkpoints: the parity fixture families, the demo model and its bundled draft ------------------------
_PLAIN: dict[str, dict] = {}  # family -> greedy outputs without speculation, computed once per session


@pytest.mark.slow  # every family at K = 1, 3, 5 (the default run has the random model against its reference)
@pytest.mark.parametrize("family,k", [(f, k) for f in FAMILIES for k in (1, 3, 5)])
def test_draft_greedy_equals_plain_greedy_on_parity_fixtures(family, k, converted):
    target = load_model(converted(family), dtype="float32")
    reference = json.loads((FIXTURES / family / "reference.json").read_text())["prompts"]
    prompts = [p["ids"] for p in reference] + [p["ids"] + p["continuation"][:16] for p in reference]
    requests = [(f"f{i}", p, greedy(32)) for i, p in enumerate(prompts)]
    if family not in _PLAIN:
        plain = LLMEngine(target, FIXTURE_ENGINE, show_progress=False)
        _PLAIN[family] = outputs(run_staggered(plain, requests, per_step=2), requests)
    engine = LLMEngine(target, with_draft(FIXTURE_ENGINE, k), show_progress=False, draft=first_layers(target))
    assert outputs(run_staggered(engine, requests, per_step=2), requests) == _PLAIN[family]
    assert engine.core.stats_snapshot().spec_decode.num_drafts > 0


@pytest.mark.slow
def test_the_demo_draft_gives_the_demo_models_greedy_output():
    """checkpoints/demo-draft, loaded by path (its tokenizer checked against the demo's), K = 1, 3, 5."""
    from jaxserve.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(DEMO)
    requests = [(f"d{i}", tokenizer.encode(t), greedy(64)) for i, t in enumerate(DEMO_TEXTS)]
    config = FIXTURE_ENGINE.replace(max_model_len=256, context_buckets=(256,))
    plain = outputs(run_staggered(LLMEngine.from_model_dir(DEMO, config, show_progress=False), requests), requests)
    for k in (1, 3, 5):
        engine = LLMEngine.from_model_dir(DEMO, with_draft(config, k, speculative_model=str(DEMO_DRAFT)),
                                          show_progress=False)
        assert outputs(run_staggered(engine, requests, per_step=2), requests) == plain, k
        spec = engine.core.stats_snapshot().spec_decode
        assert spec.num_accepted_tokens > spec.num_draft_tokens / 4, (k, spec)


def test_the_demo_draft_is_small_and_shares_the_demos_tokenizer():
    assert sum(f.stat().st_size for f in DEMO_DRAFT.rglob("*") if f.is_file()) <= 3_000_000
    assert (DEMO_DRAFT / "tokenizer.model").read_bytes() == (DEMO / "tokenizer.model").read_bytes()


# ---- the whole engine keeps the target's distribution --------------------------------------------------------
STAT_MODEL = dataclasses.replace(MODEL, vocab_size=32, hidden_size=32, intermediate_size=64, num_heads=2,
                                 num_kv_heads=1, max_position_embeddings=64)
STAT_ENGINE = EngineConfig(max_num_seqs=256, max_num_batched_tokens=1024, page_size=8, max_model_len=16,
                           decode_buckets=(256,), prefill_token_buckets=(1024,), context_buckets=(16,),
                           kv_cache_memory=2**24, xla_optimization_level=0, compilation_cache_dir="")
STAT_PROMPT, STAT_SAMPLES = [3, 17, 5], 20_000


def exact_second_and_third(target: Llama) -> tuple[np.ndarray, np.ndarray]:
    """The target's exact marginal distributions of the second and third new tokens after STAT_PROMPT
    (temperature 1): the first two a verify step makes (the first comes from the prompt's step)."""
    vocab = STAT_MODEL.vocab_size

    def next_probs(prefixes):
        return np.asarray(jax.nn.softmax(target.forward_dense(jnp.asarray(prefixes))[:, -1]), np.float64)

    first = next_probs([STAT_PROMPT])[0]
    second = next_probs([STAT_PROMPT + [a] for a in range(vocab)])  # [a, b]
    third = next_probs([STAT_PROMPT + [a, b] for a in range(vocab) for b in range(vocab)]).reshape(vocab, vocab, -1)
    joint = first[:, None] * second  # P(a, b)
    return joint.sum(0), np.einsum("ab,abc->c", joint, third)


def engine_samples(engine) -> tuple[np.ndarray, np.ndarray]:
    """Each request's second and third tokens: 4 new tokens, so its first verify step proposes K = 2."""
    requests = [(f"x{i}", STAT_PROMPT, SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True))
                for i in range(STAT_SAMPLES)]
    finals = run_staggered(engine, requests, per_step=256)
    tokens = np.asarray([finals[rid].outputs[0].token_ids for rid, _, _ in requests])
    return tokens[:, 1], tokens[:, 2]


def chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    from scipy import stats
    observed = np.bincount(samples, minlength=len(probs))
    return stats.chisquare(observed, probs / probs.sum() * len(samples)).pvalue


@pytest.fixture(scope="module")
def stat_models():
    target = random_model(STAT_MODEL, jnp.float32, seed=3)
    nnx.update(target, jax.tree.map(lambda w: w * 3 if w.ndim >= 2 else w, nnx.state(target, nnx.Param)))
    bad = random_model(dataclasses.replace(STAT_MODEL, num_layers=1), jnp.float32, seed=4)  # unrelated to it
    nnx.update(bad, jax.tree.map(lambda w: w * 6 if w.ndim >= 2 else w, nnx.state(bad, nnx.Param)))
    return target, bad


def test_sampled_outputs_with_a_bad_draft_keep_the_targets_distribution(stat_models):
    target, bad = stat_models
    engine = LLMEngine(target, with_draft(STAT_ENGINE, 2), show_progress=False, draft=bad)
    first, second = engine_samples(engine)
    spec = engine.core.stats_snapshot().spec_decode
    assert 0 < spec.num_accepted_tokens < 0.8 * spec.num_draft_tokens, spec  # a bad draft, often rejected
    want_first, want_second = exact_second_and_third(target)
    assert chi_square_p(first, want_first) > 0.01
    assert chi_square_p(second, want_second) > 0.01


@pytest.mark.slow
def test_the_engine_test_fails_with_a_broken_acceptance_rule(stat_models, monkeypatch):
    """Accepting every proposal samples the bad draft's distribution instead of the target's: the same test must
    notice. (Ignoring q is not a broken rule: accepting with p(d) and resampling from p without d is exact for a
    proposal drawn from any q, only less often accepted; the n-gram path relies on that.)"""
    from jaxserve.engine import sampler
    rule = sampler._verify_random

    def accept_everything(*args):
        drawn, accept = rule(*args)
        return drawn, jnp.ones_like(accept)

    monkeypatch.setattr(sampler, "_verify_random", accept_everything)  # the engine below traces it
    target, bad = stat_models
    first, second = engine_samples(LLMEngine(target, with_draft(STAT_ENGINE, 2), show_progress=False, draft=bad))
    want_first, want_second = exact_second_and_third(target)
    assert chi_square_p(first, want_first) < 1e-6 and chi_square_p(second, want_second) < 1e-6


def test_the_cost_model_counts_the_drafts_forward_pass(draft_engine, draft):
    from jaxserve.observability.bottleneck import model_cost
    from jaxserve.observability.cost import ModelCost
    core = draft_engine.core
    target = ModelCost.of(core.model_config, "float32", kv_bytes_per_token(core.model_config, "auto", "float32"))
    alone = ModelCost.of(draft.cfg, "float32", kv_bytes_per_token(draft.cfg, "auto", "float32"))
    cost = model_cost(core)
    assert cost == target.plus(alone)
    assert cost.step_weight_bytes == target.step_weight_bytes + alone.step_weight_bytes


def test_steps_update_the_drafts_cache_in_place(draft_engine):
    """The draft's pass sits behind lax.cond on the DRAFT_PASS flag: neither branch may copy its cache."""
    import re
    runner = draft_engine.core.runner
    cache_type = f"f32[{','.join(map(str, runner.draft_kv.k.shape))}]"
    assert runner.draft_kv.k.shape != runner.kv.k.shape  # (so the pattern finds the draft's cache only)
    for shape, executable in runner.executables.items():
        copies = [line for line in executable.as_text().splitlines()
                  if re.search(rf"= {re.escape(cache_type)}\S* copy(-start)?\(", line)]
        assert not copies, (shape, copies)


@pytest.mark.slow
def test_the_server_speculates_with_the_demo_draft():
    """What `jaxserve serve --speculative-method draft --speculative-model checkpoints/demo-draft` builds: a
    streamed completion, the spec-decode counters on /metrics, acceptance on /dashboard."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from test_server_harness import live_server
    config = FIXTURE_ENGINE.replace(max_model_len=256, context_buckets=(256,), speculative_method="draft",
                                    speculative_model=str(DEMO_DRAFT))
    with live_server(DEMO, config) as live:
        with httpx.stream("POST", f"{live.url}/v1/completions", timeout=120,
                          json={"prompt": "def read_config(path):\n", "max_tokens": 48, "temperature": 0,
                                "stream": True, "ignore_eos": True}) as response:
            assert response.status_code == 200
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert len(text) > 20
        metrics = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{live.url}/metrics").text)
                   for s in f.samples}
        assert metrics["jaxserve:spec_decode_num_drafts_total"] > 0
        assert 0 < metrics["jaxserve:spec_decode_num_accepted_tokens_total"] <= \
            metrics["jaxserve:spec_decode_num_draft_tokens_total"]
        assert "acceptance" in httpx.get(f"{live.url}/dashboard").text.lower()
