"""Tensor and data parallelism: the rules table, step messages, the replica router, and (in a subprocess with 8
forced host devices, tests/parallel_cases.py) greedy outputs of every layout against the single-device run, with
each weight's and the KV cache's placement and the compiled steps' collectives."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from jaxserve.config import ModelConfig
from jaxserve.engine.client import EngineDeadError, QueueFullError
from jaxserve.engine.messages import SchedulerStats
from jaxserve.engine.buckets import StepShape
from jaxserve.engine.multihost import StepMessage, decode, encode
from jaxserve.engine.placement import param_layout
from jaxserve.engine.replicas import ReplicaRouter, least_loaded
from jaxserve.engine.runner import StepInputs, model_step
from jaxserve.engine.sampler import NUM_FLAGS, slot_row
from jaxserve.kv.cache import CACHE_AXES, KVCache
from jaxserve.models.kernels import Kernels
from jaxserve.models.llama import abstract_model
from jaxserve.parallel import MeshError, Sharder, make_mesh
from jaxserve.parallel.multihost import StepChannel
from jaxserve.parallel.sharding import divisible_rules
from jaxserve.sampling_params import SamplingParams
from test_kernels_lowering import H200, triton_calls

CASES_SCRIPT = Path(__file__).parent / "parallel_cases.py"
MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=8, num_kv_heads=8, head_dim=16, max_position_embeddings=512,
                    dtype="float32")

# The Megatron layout, written out: column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding
# and LM head, norms replicated; the KV cache on its KV-head axis.
MEGATRON = {
    "embed": ["model", None],
    "layers/wq": [None, None, "model", None], "layers/wk": [None, None, "model", None],
    "layers/wv": [None, None, "model", None], "layers/wo": [None, "model", None, None],
    "layers/w_gate": [None, None, "model"], "layers/w_up": [None, None, "model"],
    "layers/w_down": [None, "model", None],
    "layers/attn_norm": [None, None], "layers/mlp_norm": [None, None], "final_norm": [None],
    "lm_head": [None, "model"],
}
KV_SPEC = [None, "model", None, None, None]


def run_cases(*names: str, timeout: float = 900) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "TQDM_DISABLE": "1",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(CASES_SCRIPT), *names], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def mesh(tp: int) -> AbstractMesh:
    return AbstractMesh((1, tp), ("data", "model"))


# ---- rules -----------------------------------------------------------------------------------------------------
def resolved(cfg: ModelConfig, tp: int) -> tuple[Sharder, dict]:
    layout = param_layout(cfg, np.float32)
    kv = (CACHE_AXES[:2], (cfg.num_layers, cfg.num_kv_heads))
    return Sharder(mesh(tp), divisible_rules([*layout.values(), kv], mesh(tp).shape)), layout


def test_rules_give_the_megatron_layout():
    sharder, layout = resolved(MODEL, 8)
    assert sorted(sharder.rules) == ["heads", "kv_heads", "mlp", "vocab"]
    assert {path: list(sharder.spec(axes)) for path, (axes, _) in layout.items()} == MEGATRON
    assert list(sharder.spec(CACHE_AXES)) == KV_SPEC


def test_an_axis_that_does_not_divide_stays_replicated():
    gqa = ModelConfig(**{**MODEL.__dict__, "num_kv_heads": 2})
    assert sorted(resolved(gqa, 2)[0].rules) == ["heads", "kv_heads", "mlp", "vocab"]
    sharder, layout = resolved(gqa, 4)  # 2 KV heads on 4 devices: the cache and wk/wv stay whole, heads split
    assert sorted(sharder.rules) == ["heads", "mlp", "vocab"]
    assert list(sharder.spec(CACHE_AXES)) == [None] * 5
    assert list(sharder.spec(layout["layers/wk"][0])) == [None] * 4
    assert list(sharder.spec(layout["layers/wq"][0])) == [None, None, "model", None]


def test_quantized_scales_split_with_their_values():
    int8 = ModelConfig(**{**MODEL.__dict__, "quantization": "int8", "lm_head_quantization": "int8"})
    sharder, layout = resolved(int8, 2)
    spec = {path: list(sharder.spec(axes)) for path, (axes, _) in layout.items()}
    # column-parallel: per-output-channel scales split like the outputs; row-parallel: scales (over embed) whole
    assert spec["layers/wq/values"] == [None, None, "model", None] and spec["layers/wq/scales"] == [None, "model", None]
    assert spec["layers/wo/values"] == [None, "model", None, None] and spec["layers/wo/scales"] == [None, None]
    assert spec["layers/w_down/values"] == [None, "model", None] and spec["layers/w_down/scales"] == [None, None]
    assert spec["lm_head/values"] == [None, "model"] and spec["lm_head/scales"] == ["model"]
    # int4 scales are group-wise, [L, K / G, N]: the group axis splits with K when whole groups land on each device
    int4 = ModelConfig(**{**MODEL.__dict__, "quantization": "int4", "intermediate_size": 512, "num_heads": 16})
    sharder, layout = resolved(int4, 2)
    assert layout["layers/w_down/scales"][1] == (2, 4, 64) and layout["layers/wo/scales"][1] == (2, 2, 64)
    assert list(sharder.spec(layout["layers/w_down/scales"][0])) == [None, "model", None]
    assert list(sharder.spec(layout["layers/wo/scales"][0])) == [None, "model", None]
    sharder, _ = resolved(int4, 4)  # wo's 2 groups of 128 rows span 8 heads each: heads stay whole on 4 devices
    assert sorted(sharder.rules) == ["kv_heads", "mlp", "vocab"]


def test_a_mesh_larger_than_the_devices_is_refused():
    with pytest.raises(MeshError, match="needs 16 devices"):
        make_mesh(tensor_parallel_size=8, data_parallel_size=2)


# ---- multi-host step messages ----------------------------------------------------------------------------------
def test_step_messages_round_trip():
    rows = [(3, slot_row([5, 6, 7], 3, SamplingParams(temperature=0.5, seed=1), 9, (2,), 8191)),
            (1, slot_row([8], 1, SamplingParams(), 4, (2,), 8191))]
    inputs = StepInputs(np.array([[4, 5, 0, 0], [6, 0, 0, 0]], np.int32), np.array([3, 1], np.int32),
                        np.array([0, 3, 4], np.int32), np.array([3, 1], np.int32), np.array([True, True]),
                        np.zeros(NUM_FLAGS, bool), np.array([0, 2], np.int32))
    payload = encode(StepMessage(rows, StepShape("prefill", 16, 2, 4), inputs, True))
    assert len(payload) < 16_000  # ~25 small arrays; the token rows' zero padding (2 x 32 KiB) does not travel
    message = decode(payload)
    assert message.shape == StepShape("prefill", 16, 2, 4) and message.prompt_logprobs
    for name in ("block_tables", "context_lens", "query_start", "row_slots", "sample_mask", "flags", "lora_slots"):
        np.testing.assert_array_equal(getattr(message.inputs, name), getattr(inputs, name))
        assert getattr(message.inputs, name).dtype == getattr(inputs, name).dtype
    big = StepInputs(np.zeros((256, 512), np.int32), *(np.zeros(256, np.int32) for _ in range(2)),
                     np.zeros(256, np.int32), np.zeros(256, bool), np.zeros(NUM_FLAGS, bool), np.zeros(256, np.int32))
    big.block_tables[:3, :2] = 7
    payload = encode(StepMessage([], StepShape("decode", 256, 256, 512), big, False))
    assert len(payload) < 8000  # the zero padding of a large bucket's block tables does not travel
    np.testing.assert_array_equal(decode(payload).inputs.block_tables, big.block_tables)
    assert [slot for slot, _ in message.assigns] == [3, 1]
    for (_, got), (_, want) in zip(message.assigns, rows):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
            assert np.asarray(got[name]).dtype == np.asarray(want[name]).dtype
    stop = decode(encode(StepMessage([], None)))
    assert stop.shape is None and stop.assigns == []


class FakeCoordinationClient:
    """The four calls StepChannel makes, on a dict; a missing key times out like the real client's get."""

    def __init__(self):
        self.store: dict[str, bytes | int] = {}
        self.timeouts = 0

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.store
        self.store[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        if key not in self.store:
            self.timeouts += 1
            if self.timeouts > 1:
                raise AssertionError(f"{key} never published")
            raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out")  # the runtime's status text
        return self.store[key]

    def key_value_increment(self, key, increment):
        self.store[key] = self.store.get(key, 0) + increment
        return self.store[key]

    def key_value_delete(self, key):
        del self.store[key]


def test_step_channel_delivers_in_order_and_cleans_up():
    client = FakeCoordinationClient()
    leader = StepChannel(num_followers=2, client=client)
    followers = [StepChannel(num_followers=2, client=client) for _ in range(2)]
    for payload in (b"a", b"bb", b"ccc"):
        leader.publish(payload)
    assert [followers[0].receive() for _ in range(3)] == [b"a", b"bb", b"ccc"]
    assert len([k for k in client.store if k.startswith("jaxserve/step/")]) == 3  # the other follower has not read
    assert [followers[1].receive() for _ in range(3)] == [b"a", b"bb", b"ccc"]
    assert client.store == {}  # the last reader deleted every message
    client.timeouts = 0
    with pytest.raises(AssertionError, match="never published"):
        followers[0].receive()  # an idle leader: the follower waits again after a deadline, then here gives up
    assert client.timeouts == 2


# ---- the replica router ----------------------------------------------------------------------------------------
class FakeStream:
    def __init__(self, request_id, outputs):
        self.request_id, self.finished, self._outputs, self.closed = request_id, False, list(outputs), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._outputs:
            raise StopAsyncIteration
        output = self._outputs.pop(0)
        self.finished = output.finished
        return output

    def close(self):
        self.closed = True


class FakeReplica:
    def __init__(self):
        self.accepted, self.aborted, self.num_waiting, self.num_running, self.num_queued = [], [], 0, 0, 0
        self.is_alive, self.error, self.started, self.stopped = True, None, False, False
        self.info = None

    def stats(self):
        return SchedulerStats(num_running=self.num_running, num_waiting=self.num_waiting)

    async def add_request(self, request_id, prompt, params, *, priority=0, prompt_text=None, kind=None,
                          lora_name=None):
        self.num_queued += 1  # accepted, never scheduled: these fakes do not run anything
        await asyncio.sleep(0)
        self.accepted.append(request_id)
        return FakeStream(request_id, [type("Out", (), {"finished": False})(), type("Out", (), {"finished": True})()])

    def abort(self, request_id):
        self.aborted.append(request_id)

    def start(self):
        self.started = True

    def stop(self, timeout=None):
        self.stopped = True


def test_least_loaded_prefers_the_lowest_index_on_ties():
    assert least_loaded([2, 1, 1]) == 1 and least_loaded([0, 0]) == 0 and least_loaded([3, 4, 0]) == 2


def test_router_spreads_a_burst_and_frees_load_when_requests_end():
    replicas = [FakeReplica(), FakeReplica()]
    router = ReplicaRouter(replicas).start()
    assert all(r.started for r in replicas)

    async def burst():
        streams = await asyncio.gather(*(router.add_request(f"r{i}", [1, 2], SamplingParams()) for i in range(5)))
        assert router.loads == [3, 2]  # arrivals counted before any replica stepped
        router.abort("r1")
        assert replicas[1].aborted == ["r1"]
        async for _ in streams[0]:
            pass
        streams[1].close()
        return router.loads

    assert asyncio.run(burst()) == [2, 1]  # r0 finished, r1 closed
    assert replicas[0].accepted == ["r0", "r2", "r4"] and replicas[1].accepted == ["r1", "r3"]
    router.stop()
    assert all(r.stopped for r in replicas)


def test_router_counts_a_burst_its_replicas_have_not_seen_yet():
    router = ReplicaRouter([FakeReplica(), FakeReplica()], max_queued_requests=3)

    async def burst():
        for i in range(3):
            await router.add_request(f"r{i}", [1], SamplingParams())  # the replicas still report 0 waiting
        with pytest.raises(QueueFullError, match="3 requests"):
            await router.add_request("r3", [1], SamplingParams())

    asyncio.run(burst())


def test_router_shares_one_admission_limit_and_reports_dead_replicas():
    replicas = [FakeReplica(), FakeReplica()]
    replicas[0].num_waiting, replicas[1].num_waiting, replicas[1].num_running = 2, 1, 4
    replicas[0].num_queued, replicas[1].num_queued = 2, 1
    router = ReplicaRouter(replicas, max_queued_requests=3)
    assert (router.stats().num_waiting, router.stats().num_running) == (3, 4)
    with pytest.raises(QueueFullError):
        asyncio.run(router.add_request("x", [1], SamplingParams()))
    replicas[1].num_queued = 0
    asyncio.run(router.add_request("y", [1], SamplingParams()))
    replicas[1].is_alive, replicas[1].error = False, RuntimeError("boom")
    assert not router.is_alive and isinstance(router.error, RuntimeError)
    with pytest.raises(EngineDeadError, match="boom"):
        asyncio.run(router.add_request("z", [1], SamplingParams()))


# ---- 8 host devices --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eight_devices():
    """Single-device reference, tensor-parallel 8, and 2 replicas x tensor-parallel 2, on 8 forced CPU devices."""
    return run_cases("reference", "tp8", "dp2")


def test_tensor_and_data_parallel_greedy_equal_single_device(eight_devices):
    reference = eight_devices["reference"]["tokens"]
    assert eight_devices["tp8"]["tokens"] == reference
    assert eight_devices["dp2"]["tokens"] == reference


def test_every_weight_and_the_kv_cache_have_the_intended_sharding(eight_devices):
    tp8 = eight_devices["tp8"]
    assert set(tp8["weights"]) == set(MEGATRON)
    for path, placed in tp8["weights"].items():
        assert placed["spec"] == MEGATRON[path], path
        assert placed["devices"] == list(range(8)), path
    assert tp8["weights"]["layers/wq"]["shard_shape"] == [2, 64, 1, 16]  # one head per device
    assert tp8["weights"]["embed"]["shard_shape"] == [64, 64]  # 512 / 8 vocab rows
    assert tp8["kv"]["spec"] == KV_SPEC and tp8["kv"]["shard_shape"][1] == 1  # one KV head per device
    assert tp8["slots"]["spec"] == [] and tp8["slots"]["devices"] == list(range(8))  # replicated


def test_tensor_parallel_steps_reduce_activations_never_gather_weights(eight_devices):
    tp8 = eight_devices["tp8"]
    for shape, step in tp8["steps"].items():
        kinds = {name.split()[0] for name in step["collectives"]}
        assert kinds <= {"all-reduce", "all-gather"}, (shape, step)
        # embedding, attention-out and MLP-down partial sums (the layer scan's body counts once), and the logits
        assert sum(n for name, n in step["collectives"].items() if name.startswith("all-reduce")) == 3, shape
        for name in step["collectives"]:
            elements = np.prod([int(d) for d in name.split("[")[1].split("]")[0].split(",")])
            assert elements <= 32 * 512, (shape, name)  # activations or logits, never a weight
        assert step["alias_bytes"] >= tp8["kv_cache_bytes"], shape  # the donated cache shard is updated in place


def test_replicas_run_on_disjoint_devices_and_share_the_work(eight_devices):
    dp2 = eight_devices["dp2"]
    assert dp2["replica_devices"] == [[0, 1], [2, 3]]
    assert dp2["weights_on"] == [[0, 1], [2, 3]] and dp2["kv_on"] == [[0, 1], [2, 3]]
    assert dp2["routed_to"] == [0, 1, 0, 1]


@pytest.mark.slow
def test_every_layout_matches_its_single_device_reference():
    """Tensor-parallel 2 and 4; 2 KV heads (split on 2 devices, whole on 4); Pallas attention (interpret mode) under
    shard_map; int8 weights with their scales split alongside, through XLA and through the Pallas matmul."""
    r = run_cases("reference", "tp2", "tp4", "pallas_tp2", "gqa_reference", "gqa_tp2", "gqa_tp4",
                  "int8_reference", "int8_tp2", "int8_pallas_tp2")
    for name in ("tp2", "tp4", "pallas_tp2"):
        assert r[name]["tokens"] == r["reference"]["tokens"], name
    for name in ("gqa_tp2", "gqa_tp4"):
        assert r[name]["tokens"] == r["gqa_reference"]["tokens"], name
    assert r["int8_tp2"]["tokens"] == r["int8_reference"]["tokens"]
    assert r["int8_pallas_tp2"]["tokens"] == r["int8_reference"]["tokens"]  # the Pallas matmul under shard_map
    assert r["gqa_tp2"]["kv"]["spec"] == KV_SPEC
    assert r["gqa_tp4"]["kv"]["spec"] == [None] * 5 and "kv_heads" not in r["gqa_tp4"]["rules"]
    assert r["gqa_tp4"]["weights"]["layers/wq"]["spec"] == [None, None, "model", None]
    int8 = r["int8_tp2"]["weights"]
    assert int8["layers/wq/values"]["spec"] == [None, None, "model", None]
    assert int8["layers/wq/scales"]["spec"] == [None, "model", None]
    assert int8["layers/w_down/values"]["spec"] == [None, "model", None]
    assert int8["layers/w_down/scales"]["spec"] == [None, None]
    assert int8["lm_head/scales"]["spec"] == ["model"]


@pytest.mark.slow
def test_imported_formats_under_tensor_parallelism_match_the_single_device_run():
    """int4 with zero points and act-order (the x gather before a K-split row-parallel weight), an fp8 LM head:
    zeros split with their scales, the permutation stays whole, tokens equal the single-device run."""
    r = run_cases("zp_act_reference", "zp_act_tp2", "zp_act_pallas_tp2")
    assert r["zp_act_tp2"]["tokens"] == r["zp_act_reference"]["tokens"]
    assert r["zp_act_pallas_tp2"]["tokens"] == r["zp_act_reference"]["tokens"]
    weights = r["zp_act_tp2"]["weights"]
    for name in ("wq", "wo", "w_down"):
        assert weights[f"layers/{name}/zeros"]["spec"] == weights[f"layers/{name}/scales"]["spec"], name
        assert weights[f"layers/{name}/perm"]["spec"] == [None, None], name
    assert weights["layers/w_down/scales"]["spec"] == [None, "model", None]
    assert weights["lm_head/values"]["spec"] == [None, "model"] and weights["lm_head/scales"]["spec"] == ["model"]
# ---- Mixture of Experts on 8 host devices --------------------------------------------------------------------------
def _assert_moe_case(case: dict, expert_spec: list) -> None:
    assert case["tokens"] == case["expected"]  # transformers' greedy tokens, as the single-device engine gives
    assert case["weights"]["layers/we_gate"]["spec"] == expert_spec
    assert case["weights"]["layers/router"]["spec"] == [None, None, None]  # the router is replicated
    for shape, step in case["steps"].items():
        kinds = {name.split()[0] for name in step["collectives"]}
        assert kinds <= {"all-reduce", "all-gather"}, (shape, step)
        for name in step["collectives"]:
            elements = np.prod([int(d) for d in name.split("[")[1].split("]")[0].split(",")])
            assert elements <= 64 * 512, (shape, name)  # activations or logits, never an expert's weights


def test_moe_expert_and_tensor_parallel_give_the_single_device_tokens():
    """Expert parallelism (8 experts, one per device) and tensor parallelism inside the experts (4 experts on 8
    devices: each expert's MLP split 8 ways) both give the greedy tokens of one device."""
    r = run_cases("qwen3moe_tp8", "mixtral_tp8")
    _assert_moe_case(r["qwen3moe_tp8"], [None, "model", None, None])
    assert r["qwen3moe_tp8"]["weights"]["layers/we_gate"]["shard_shape"][1] == 1  # one expert per device
    _assert_moe_case(r["mixtral_tp8"], [None, None, None, "model"])
    assert "experts" not in r["mixtral_tp8"]["rules"]


@pytest.mark.slow
def test_moe_expert_parallel_beside_split_attention_heads():
    r = run_cases("qwen3moe_tp2")
    _assert_moe_case(r["qwen3moe_tp2"], [None, "model", None, None])
    assert r["qwen3moe_tp2"]["weights"]["layers/wq"]["spec"] == [None, None, "model", None]


# ---- CUDA lowering -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [StepShape("decode", 8, 8, 4), StepShape("prefill", 32, 4, 4)], ids=str)
def test_pallas_kernels_lower_for_cuda_on_their_devices_shards(monkeypatch, shape):
    """The tensor-parallel step with Pallas attention and the int8 Pallas matmul, lowered for an abstract pair of
    H200s: every Triton kernel sees only its device's shard (GSPMD cannot split a kernel, so outside shard_map it
    would be handed whole, gathered weights), and the row-parallel products are summed across devices."""
    cfg = ModelConfig(**{**MODEL.__dict__, "dtype": "bfloat16", "quantization": "int8", "intermediate_size": 384})
    graphdef, params = nnx.split(abstract_model(cfg, jnp.bfloat16))
    kv = jax.eval_shape(lambda: KVCache.zeros(2, 8, 64, 16, 16, jnp.bfloat16))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    s = shape.seqs
    inputs = StepInputs(i32(s, 4), i32(s), i32(s + 1), i32(s), jax.ShapeDtypeStruct((s,), jnp.bool_),
                        jax.ShapeDtypeStruct((6,), jnp.bool_), i32(s))
    step = functools.partial(model_step, graphdef, shape=shape, page_size=16,
                             kernels=Kernels.resolve("pallas", "pallas"))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the model picks compiled kernels, not interpret
    pair = AbstractMesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, abstract_device=H200)
    with jax.sharding.use_abstract_mesh(pair):
        lowered = jax.jit(step).trace(params, kv, i32(9, 129), inputs).lower(lowering_platforms=("cuda",))
    operands = {t for call in triton_calls(lowered) for t in call["operand_types"]}
    assert "tensor<2x4x64x16x16xbf16>" in operands  # the KV pools: 4 of the 8 KV heads
    weights = {t for t in operands if t.endswith("xi8>")}
    # q/k/v/o: [64, 128] / [128, 64] halved; gate/up [64, 384] on N, down [384, 64] on K: local shards only
    assert weights == {"tensor<64x64xi8>", "tensor<64x192xi8>", "tensor<192x64xi8>"}
    assert lowered.as_text().count("stablehlo.all_reduce") == 2  # o and down: partial products summed


def test_moe_step_lowers_for_cuda_with_the_experts_split(monkeypatch):
    """A Mixtral-style step on an abstract pair of H200s: the grouped matmuls lower for CUDA (XLA's ragged dot)
    inside the shard_map over experts, where each device holds 2 of the 4 experts."""
    cfg = ModelConfig(**{**MODEL.__dict__, "architecture": "MixtralForCausalLM", "dtype": "bfloat16",
                         "num_experts": 4, "num_experts_per_tok": 2})
    graphdef, params = nnx.split(abstract_model(cfg, jnp.bfloat16))
    kv = jax.eval_shape(lambda: KVCache.zeros(2, 8, 64, 16, 16, jnp.bfloat16))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    shape = StepShape("prefill", 32, 4, 4)
    inputs = StepInputs(i32(4, 4), i32(4), i32(5), i32(4), jax.ShapeDtypeStruct((4,), jnp.bool_),
                        jax.ShapeDtypeStruct((NUM_FLAGS,), jnp.bool_), i32(4))
    step = functools.partial(model_step, graphdef, shape=shape, page_size=16, kernels=Kernels.resolve("xla", "xla"))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the model picks the GPU's grouped matmul
    pair = AbstractMesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, abstract_device=H200)
    with jax.sharding.use_abstract_mesh(pair):
        lowered = jax.jit(step).trace(params, kv, i32(9, 129), inputs).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "ragged_dot" in text, "the grouped matmul must lower as a ragged dot, not a loop over experts"
    assert "tensor<2x64x128xbf16>" in text  # inside the shard_map: this device's 2 experts of [64, 128]
