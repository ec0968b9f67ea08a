"""LoRA adapters: PEFT directories read directly, refusals, slot bookkeeping, and batched multi-adapter serving
that gives every request the tokens of its adapter merged into the base weights (computed independently)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.lora.registry import LoraInUseError
from jaxserve.kv.allocator import page_hashes
from jaxserve.lora import LoRARequest
from jaxserve.lora.adapter import LoraError, read_adapter
from jaxserve.lora.slots import AdapterSlots
from jaxserve.lora.weights import merged_weights
from jaxserve.sampling_params import SamplingParams
from lora_adapters import merged_model, write_adapter
from test_engine import MODEL, model  # noqa: F401 (the fixture)

ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=128,
                      decode_buckets=(1, 2, 4, 8), prefill_token_buckets=(16, 64), context_buckets=(128,),
                      kv_cache_memory=2**21, xla_optimization_level=0, compilation_cache_dir="",
                      enable_lora=True, max_loras=2, max_lora_rank=8)
# three adapters of two ranks and different target sets, through two slots: the third waits and swaps in
ADAPTERS = {"sql": dict(rank=4, seed=1), "chat": dict(rank=8, seed=2, modules=("q_proj", "v_proj", "down_proj")),
            "math": dict(rank=2, seed=3, modules=("k_proj", "o_proj", "gate_proj", "up_proj"), use_rslora=True)}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(root / name, MODEL, **kwargs) for name, kwargs in ADAPTERS.items()}


@pytest.fixture(scope="module")
def engine(model, adapter_dirs):
    return LLMEngine(model, ENGINE.replace(lora_modules=(f"sql={adapter_dirs['sql']}",)), show_progress=False)


@pytest.fixture(scope="module")
def reference(model, adapter_dirs):
    """Greedy continuation of one sequence by full recomputation with the adapter merged into the weights."""
    forwards = {None: jax.jit(lambda t: model.forward_dense(t[None])[0])}
    for name, path in adapter_dirs.items():
        merged = merged_model(model, path)
        forwards[name] = jax.jit(lambda t, m=merged: m.forward_dense(t[None])[0])

    def continue_greedy(adapter, prompt, num_tokens):
        tokens = list(prompt)
        for _ in range(num_tokens):
            padded = np.zeros(ENGINE.max_model_len, np.int32)
            padded[:len(tokens)] = tokens
            tokens.append(int(jnp.argmax(forwards[adapter](padded)[len(tokens) - 1])))
        return tokens[len(prompt):]

    return continue_greedy


def greedy(max_tokens, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def lora(adapter_dirs, name):
    return None if name is None else LoRARequest(name, 1, str(adapter_dirs[name]))


# ---- reading PEFT directories ----------------------------------------------------------------------------------
def test_adapter_factors_give_the_merged_weights(model, adapter_dirs, tmp_path):
    """W + scale * B @ A, computed here in Hugging Face layout, equals what jaxserve's factors multiply to, for
    alpha/r, rsLoRA's alpha/sqrt(r), two ranks, partial target sets and alpha_pattern."""
    patterned = write_adapter(tmp_path / "patterned", MODEL, rank=4, seed=7,
                              extra_config={"alpha_pattern": {"v_proj": 32}})
    cases = dict(adapter_dirs, patterned=patterned)
    for name, path in cases.items():
        adapter = read_adapter(path, MODEL, max_rank=8)
        ours = merged_weights(model, adapter)
        expected = merged_model(model, path) if name != "patterned" else None
        if expected is None:  # alpha_pattern: v_proj scaled by 32 / 4, the rest by 8 / 4
            config = json.loads((path / "adapter_config.json").read_text())
            assert config["alpha_pattern"] == {"v_proj": 32}
            cfg_v = dict(config, lora_alpha=32, alpha_pattern={})
            (tmp_path / "v_only").mkdir(exist_ok=True)
            (tmp_path / "v_only" / "adapter_config.json").write_text(json.dumps(cfg_v))
            (tmp_path / "v_only" / "adapter_model.safetensors").write_bytes(
                (path / "adapter_model.safetensors").read_bytes())
            v_ref = merged_model(model, tmp_path / "v_only").layers.wv[...]
            np.testing.assert_allclose(ours["wv"], v_ref, rtol=1e-5, atol=1e-4)
            expected = merged_model(model, path)
            names = set(ours) - {"wv"}
        else:
            names = set(ours)
        for weight in names:
            np.testing.assert_allclose(ours[weight], getattr(expected.layers, weight)[...], rtol=1e-5, atol=1e-4,
                                       err_msg=f"{name}: {weight}")


@pytest.mark.parametrize("case, message", [
    (dict(extra_config={"use_dora": True}), "DoRA"),
    (dict(extra_tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                         np.ones(64, np.float32)}), "DoRA"),
    (dict(extra_tensors={"base_model.model.model.embed_tokens.lora_embedding_A": np.ones((4, 512), np.float32)}),
     "embedding"),
    (dict(extra_config={"target_modules": ["q_proj", "lm_head"]}), "LM head"),
    (dict(extra_tensors={"base_model.model.lm_head.lora_A.weight": np.ones((4, 64), np.float32)}), "LM-head"),
    (dict(extra_config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(extra_config={"bias": "lora_only"}), "biases"),
    (dict(rank=16), "exceeds --max-lora-rank 8"),
    (dict(base=ModelConfig(**{**MODEL.__dict__, "hidden_size": 32})), "another base model"),
    (dict(base=ModelConfig(**{**MODEL.__dict__, "num_layers": 3})), "another base model"),
])
def test_unsupported_adapters_are_refused_with_a_reason(tmp_path, case, message):
    case = dict(case)
    base = case.pop("base", MODEL)
    path = write_adapter(tmp_path / "adapter", base, **case)
    with pytest.raises(LoraError, match=message):
        read_adapter(path, MODEL, max_rank=8)


def test_a_directory_without_adapter_files_is_refused(tmp_path):
    with pytest.raises(LoraError, match="no adapter_config.json"):
        read_adapter(tmp_path, MODEL)


# ---- host bookkeeping ------------------------------------------------------------------------------------------
def test_slots_are_refcounted_and_evicted_least_recently_used():
    slots = AdapterSlots(2)
    assert slots.acquire(10) == 1 and slots.acquire(20) == 2 and slots.acquire(10) == 1
    assert slots.take_loads() == ((1, 10), (2, 20)) and slots.take_loads() == ()
    assert not slots.can_acquire(30)  # both slots hold adapters in use: a third waits
    slots.release(20)
    slots.release(10)
    assert slots.can_acquire(30)
    slots.release(10)  # 20 went idle first, so it is evicted first
    assert slots.acquire(30) == 2 and slots.take_loads() == ((2, 30),)
    assert slots.slot_of(20) is None and slots.slot_of(10) == 1
    assert slots.acquire(10) == 1 and slots.take_loads() == ()  # still loaded: no write
    slots.check_invariants()
    with pytest.raises(ValueError, match="still in use"):
        slots.forget(10)
    slots.release(10)
    slots.forget(10)
    assert slots.can_acquire(40) and slots.slot_of(10) is None
    slots.check_invariants()


def test_page_hashes_depend_on_the_adapter():
    tokens = list(range(32))
    base, one, two = (page_hashes(tokens, 8, salt=s) for s in (b"", b"a" * 16, b"b" * 16))
    assert len(base) == 4 and not set(base) & set(one) and not set(one) & set(two)
    assert page_hashes(tokens, 8, one[:2], salt=b"a" * 16) == one  # extending keeps the chain


# ---- serving ---------------------------------------------------------------------------------------------------
def run_staggered(engine, requests, per_step=2):
    pending, finals = list(requests), {}
    while pending or engine.has_unfinished_requests():
        for request_id, prompt, params, adapter in pending[:per_step]:
            engine.add_request(request_id, prompt, params, lora_request=adapter)
        pending = pending[per_step:]
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.core.scheduler.check_invariants()
    return finals


def test_mixed_adapters_in_one_batch_match_each_adapter_merged(engine, adapter_dirs, reference):
    """Base requests and requests for three adapters interleaved with staggered arrivals, through two slots:
    every request gets exactly the greedy tokens of its adapter merged into the base weights, run alone; the
    compile count does not grow while adapters load and swap."""
    compiled = engine.core.runner.num_executables
    rng = np.random.default_rng(0)
    names = [None, "sql", "chat", "math"]
    requests = []
    for i in range(12):
        adapter = names[i % 4]
        prompt = rng.integers(1, MODEL.vocab_size, size=int(rng.integers(3, 40))).tolist()
        requests.append((f"r{i}", prompt, greedy(int(rng.integers(4, 12))), lora(adapter_dirs, adapter)))
    finals = run_staggered(engine, requests)
    for request_id, prompt, params, adapter in requests:
        name = adapter.lora_name if adapter else None
        assert list(finals[request_id].outputs[0].token_ids) == reference(name, prompt, params.max_tokens), \
            f"{request_id} ({name})"
    assert engine.core.runner.num_executables == compiled
    assert {info.name for info in engine.core.lora_infos()} == {"sql", "chat", "math"}


def test_adapters_actually_change_the_output(engine, adapter_dirs, reference):
    prompt = list(range(5, 30))
    continuations = {name: tuple(reference(name, prompt, 8)) for name in (None, "sql", "chat", "math")}
    assert len(set(continuations.values())) == 4  # otherwise the mixed-batch test would prove little


def test_n_samples_share_the_adapter(engine, adapter_dirs, reference):
    prompt = list(range(40, 75))
    engine.add_request("n2", prompt, greedy(6, n=2), lora_request=lora(adapter_dirs, "chat"))
    (final,) = [o for o in engine.run_until_done() if o.request_id == "n2"]
    expected = reference("chat", prompt, 6)
    assert [list(s.token_ids) for s in final.outputs] == [expected, expected]


def test_prefix_cache_is_keyed_by_adapter(engine, adapter_dirs, reference):
    """The same prompt under another adapter computes its own KV pages; under the same adapter it reuses them."""
    prompt = list(range(100, 140))  # five full pages
    stats = engine.core.scheduler.allocator.stats

    def run(request_id, name):
        hits = stats.hits
        engine.add_request(request_id, prompt, greedy(4), lora_request=lora(adapter_dirs, name))
        (final,) = [o for o in engine.run_until_done() if o.request_id == request_id]
        assert list(final.outputs[0].token_ids) == reference(name, prompt, 4)
        return stats.hits - hits

    assert run("p-sql", "sql") == 0
    assert run("p-math", "math") == 0  # same tokens, other adapter: no shared pages
    assert run("p-base", None) == 0
    assert run("p-sql-again", "sql") == 32  # four reusable pages of its own adapter


def test_unload_refuses_while_in_use_and_reload_gets_fresh_pages(engine, adapter_dirs, reference):
    core = engine.core
    engine.add_request("busy", list(range(1, 20)), greedy(3), lora_request=lora(adapter_dirs, "math"))
    with pytest.raises(LoraInUseError, match="in use by 1 unfinished"):
        core.remove_lora("math")
    engine.run_until_done()
    core.remove_lora("math")
    assert "math" not in {info.name for info in core.lora_infos()}
    with pytest.raises(KeyError):
        core.remove_lora("math")
    with pytest.raises(LoraError, match="not loaded"):
        from jaxserve.engine.messages import EngineRequest
        core.add_request(EngineRequest("x", (1, 2, 3), greedy(2), 0.0, lora_name="math"))
    # loaded again from other files under the same name: its old prefix pages must not be reused
    core.add_lora("math", str(adapter_dirs["chat"]))
    prompt = list(range(100, 140))
    engine.add_request("reloaded", prompt, greedy(4), lora_request=LoRARequest("math", 1, ""))
    (final,) = [o for o in engine.run_until_done() if o.request_id == "reloaded"]
    assert list(final.outputs[0].token_ids) == reference("chat", prompt, 4)
    core.remove_lora("math")
    core.add_lora("math", str(adapter_dirs["math"]))
    core.scheduler.check_invariants()


def test_lora_requests_need_enable_lora(model, adapter_dirs):
    with pytest.raises(ConfigError, match="needs --enable-lora"):
        LLMEngine(model, ENGINE.replace(enable_lora=False, lora_modules=("a=/x",)), show_progress=False)


def test_merged_mode_serves_the_adapter_at_base_speed(model, adapter_dirs, reference):
    """--merge-lora: the one adapter merged into the weights at load; requests name it or the base alike."""
    config = ENGINE.replace(enable_lora=False, merge_lora=True, lora_modules=(f"chat={adapter_dirs['chat']}",),
                            max_num_seqs=2, decode_buckets=(2,), prefill_token_buckets=(64,))
    merged = LLMEngine(model, config, show_progress=False)
    assert [info.name for info in merged.core.lora_infos()] == ["chat"]
    assert "lora" not in merged.core.runner.params["layers"]
    prompt = list(range(7, 31))
    merged.add_request("m", prompt, greedy(6), lora_request=LoRARequest("chat", 1, ""))
    merged.add_request("b", prompt, greedy(6))
    finals = {o.request_id: list(o.outputs[0].token_ids) for o in merged.run_until_done()}
    assert finals == {"m": reference("chat", prompt, 6), "b": reference("chat", prompt, 6)}
    assert list(reference(None, prompt, 6)) != finals["b"]  # the model it was built from is untouched
    with pytest.raises(ConfigError, match="exactly one adapter"):
        LLMEngine(model, config.replace(lora_modules=()), show_progress=False)


@pytest.mark.slow
def test_tensor_parallel_lora_equals_one_device():
    """A/B split like their base projection (column-parallel: b on heads / mlp; row-parallel: a on the inputs'
    heads / mlp), and a mixed batch gives the one-device tokens on 4 devices."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "lora_tp_case.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tp4"] == result["tp1"]
    assert len({tuple(t) for t in result["tp1"]}) == 4
    specs = result["specs4"]
    assert specs["wq_a"] == [None, None, None, None] and specs["wq_b"] == [None, None, None, "model", None]
    assert specs["wo_a"] == [None, "model", None, None, None] and specs["wo_b"] == [None, None, None, None]
    assert specs["w_down_a"] == [None, "model", None, None] and specs["w_down_b"] == [None, None, None, None]


def test_scheduler_makes_an_adapter_wait_for_a_slot_while_others_run():
    """Two slots, three adapters: the third adapter's request waits (it does not fail) while a base request behind
    it is admitted; it runs as soon as a slot frees, with the slot's load in that step's plan. With one step in
    flight (lag=1), as the engine runs."""
    from fakes import FakeDevice, run_to_completion
    from jaxserve.kv.allocator import PageAllocator
    from jaxserve.scheduler.scheduler import Scheduler, SchedulerConfig
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, page_size=4)
    sched = Scheduler(config, PageAllocator(64, 4), adapter_slots=AdapterSlots(2))
    for i, (adapter, n) in enumerate([(1, 6), (2, 3), (3, 2), (0, 2)]):
        sched.add_request(f"r{i}", [i + 1] * 5, greedy(n), lora_id=adapter)
    plans = []

    def check(plan):
        plans.append(plan)
        sched.check_invariants()

    run_to_completion(sched, FakeDevice(64, 4, config.num_slots), lag=1, on_step=check)
    first = {row.request_id: row.lora_slot for row in plans[0].seqs}
    assert first == {"r0": 1, "r1": 2, "r3": 0} and plans[0].lora_loads == ((1, 1), (2, 2))
    started = next(i for i, p in enumerate(plans) if any(row.request_id == "r2" for row in p.seqs))
    assert plans[started].lora_loads == ((2, 3),)  # r1 (adapter 2, 3 tokens) finished first: its slot is reused
    assert all(row.lora_slot == 2 for p in plans[started:] for row in p.seqs if row.request_id == "r2")
    assert sched.adapter_slots.slot_of(2) is None and sched.adapter_slots.slot_of(1) == 1


def test_preempted_sequences_give_back_and_retake_their_adapter_slot():
    """Few KV pages: sequences of three adapters (two slots) preempt each other; slots are released with the pages
    and retaken on readmission, outputs stay exact and the bookkeeping consistent after every step."""
    from fakes import FakeDevice, reference_continuation, run_to_completion
    from jaxserve.kv.allocator import PageAllocator
    from jaxserve.scheduler.scheduler import Scheduler, SchedulerConfig
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, page_size=4)
    sched = Scheduler(config, PageAllocator(14, 4), adapter_slots=AdapterSlots(2))
    seqs = [sched.add_request(f"r{i}", [i + 3] * 6, greedy(20), lora_id=i % 3 + 1)[0] for i in range(5)]
    run_to_completion(sched, FakeDevice(14, 4, config.num_slots), lag=1, on_step=lambda plan: sched.check_invariants())
    assert sched.num_preemptions > 0
    for i, seq in enumerate(seqs):
        assert seq.output_token_ids == reference_continuation([i + 3] * 6, 20)
    assert all(sched.adapter_slots.refcount(a) == 0 for a in sched.adapter_slots.loaded)


def test_adapters_on_int8_base_weights_match_the_dense_path(model, adapter_dirs):
    """With int8 base projections the LoRA term adds to the quantized product: the batched, paged engine gives the
    tokens of the dense (no cache) forward of the same int8 model with the same adapter slot written by hand."""
    from jaxserve.lora import weights as lw
    from jaxserve.quant.model import quantize_model
    quantized = quantize_model(model, "int8")
    config = ENGINE.replace(max_num_seqs=4, decode_buckets=(4,), prefill_token_buckets=(64,), max_loras=1)
    engine = LLMEngine(quantized, config, show_progress=False)
    prompts = [list(range(3, 20)), list(range(50, 61)), list(range(90, 130))]
    adapters = [None, lora(adapter_dirs, "sql"), lora(adapter_dirs, "sql")]
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        engine.add_request(str(i), prompt, greedy(8), lora_request=adapter)
    got = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run_until_done()}

    dense = lw.attach(quantized, 1, ENGINE.max_lora_rank)
    lora_state = dense.layers.lora
    factors = {k: getattr(lora_state, k)[...] for k in lw.slot_values(None, MODEL, ENGINE.max_lora_rank)}
    adapter = read_adapter(adapter_dirs["sql"], MODEL, ENGINE.max_lora_rank)
    written = lw.write_slot(factors, 1, lw.slot_values(adapter, MODEL, ENGINE.max_lora_rank))
    for k, v in written.items():
        getattr(lora_state, k).set_value(v)
    forward = jax.jit(lambda t, s: dense.forward_dense(t[None], lora_slots=s[None])[0])
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        tokens = list(prompt)
        for _ in range(8):
            padded = np.zeros(ENGINE.max_model_len, np.int32)
            padded[:len(tokens)] = tokens
            slots = np.full(ENGINE.max_model_len, 0 if adapter is None else 1, np.int32)
            tokens.append(int(jnp.argmax(forward(padded, slots)[len(tokens) - 1])))
        assert got[str(i)] == tokens[len(prompt):], f"request {i}"
