#!/usr/bin/env python3
"""Offline throughput of the engine, and how close its decode step comes to this machine's floor.

For each batch size N: N requests of random-token prompts (input-len tokens) each generating exactly output-len
tokens (EOS ignored, greedy), all submitted at once. Reports output and total tokens/s, the mean decode step time,
and, measured in the same run, the bare weight matmuls of one decode step at that batch (the floor: every weight
read once, no attention, no sampling, no host work; on a CPU also with one array per layer, see
weight_matmul_floor), the ratio between the two, and the share of wall time the device sat idle waiting for the host.
`host_cpu_ms_per_step` is the CPU time of the thread running the engine loop (scheduling, dispatch, reading
results, output processing) per step of the timed run (`steps`; `calls`: executable calls, fewer with decode
bursts), and `host_cpu_share` that over the wall time: where the host's cores are also the device's (a CPU
backend), that time is taken from the step's own threads, so it adds to the step rather than hiding behind it
once the cores are busy. A decode burst (several decode steps in one call, the CPU's default at small batches)
counts as its steps, each its share of the call's time. The workload is timed --repeats times (3); step times
are the median run's mean step (`decode_step_ms_runs`: each run's), throughput the median run's.
`decode_weight_gb_s` is the weight bytes one decode step must read over the mean step time, and
`decode_weight_bw_vs_copy` (CPU) that over the copy bandwidth (bench/cpu_matmul.py) measured right after each run,
the median of the runs' ratios (`decode_weight_bw_vs_copy_runs`): on a shared VM memory bandwidth moves by a third
within minutes, and a copy measured next to each run tracks it where one copy per process does not.

    python bench/offline_throughput.py --preset small --batch-sizes 1 16 64
    python bench/offline_throughput.py --model checkpoints/demo --batch-sizes 8
    python bench/offline_throughput.py --preset llama3-8b --batch-sizes 1 16 64 256 --out e2e.json   # GPU
    python bench/offline_throughput.py --preset moe-small --batch-sizes 1 16 64   # a small random Mixtral-style MoE

For a MoE preset the floor's MLP is the router plus, for each expert the batch's tokens are routed to, one dense
gated MLP over exactly those tokens (routing of the floor's batch, fixed before compiling; bench/moe_grouped.py
floor_fn): the matmuls of the experts actually hit, not every expert and no grouping overhead. On XLA:CPU those
small exact-size matmuls run slower than the engine's grouped kernel, so that timed floor is no floor there;
`hardware_floor` is: the weight bytes the step must read (the experts hit) over the read bandwidth measured in the
same run, or its FLOPs over the measured matmul rate, whichever binds (`decode_vs_hardware_floor`, every preset).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import EngineConfig, ModelConfig, RopeConfig
from jaxserve.engine import replicas
from jaxserve.engine.engine import EngineCore, LLMEngine, resolve_dtype
from jaxserve.engine.replicas import DataParallelCore
from jaxserve.outputs import OutputKind
from jaxserve.models import moe
from jaxserve.models.linear import dense
from jaxserve.models.llama import numpy_dtype, random_model
from jaxserve.sampling_params import SamplingParams
from cpu_matmul import copy_bandwidth  # bench/: numpy copy of 512 MB, read + write bytes counted
from moe_grouped import emit, floor_fn, timed  # bench/: the MoE floor (each expert hit over exactly its tokens)

PRESETS = {
    # the peers' random Llamas (../shared/peers/make_models.py)
    "tiny": dict(vocab_size=8000, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=2),
    "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                  num_kv_heads=4),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, rope=RopeConfig(theta=500000.0)),
    # Mixtral's routing (8 experts, top 2) at a size this CPU runs: 8 x 0.5M-parameter experts per layer
    "moe-small": dict(architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=512, intermediate_size=1024,
                      num_layers=8, num_heads=8, num_kv_heads=4, num_experts=8, num_experts_per_tok=2),
    # one Mixtral-8x7B-shaped model, cut to 4 layers (the GPU row of bench/gpu_check.sh)
    "mixtral-layers": dict(architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=4096,
                           intermediate_size=14336, num_layers=4, num_heads=32, num_kv_heads=8, num_experts=8,
                           num_experts_per_tok=2, rope=RopeConfig(theta=1e6)),
}


def preset_config(name: str, dtype: str) -> ModelConfig:
    spec = dict(PRESETS[name])
    spec.setdefault("rope", RopeConfig())
    spec.setdefault("architecture", "LlamaForCausalLM")
    return ModelConfig(head_dim=spec["hidden_size"] // spec["num_heads"], max_position_embeddings=8192, dtype=dtype,
                       **spec)


def build_engine(args) -> LLMEngine:
    options = dict(max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.input_len + args.output_len, tensor_parallel_size=args.tensor_parallel_size,
                   data_parallel_size=args.data_parallel_size)
    config = EngineConfig(**{**options, **json.loads(args.engine_args)})
    if args.model:
        return replicas.build_engine(args.model, config)
    cfg = dataclasses.replace(preset_config(args.preset, args.dtype), quantization=args.quantize)
    model = random_model(cfg, numpy_dtype(resolve_dtype(config.dtype, args.dtype)), seed=0)
    if config.data_parallel_size > 1:
        return LLMEngine.from_core(DataParallelCore([EngineCore(model, config, mesh=mesh)
                                                     for mesh in replicas.data_parallel_meshes(config)]))
    return LLMEngine(model, config, owns_model=True)


def run_batch_replicas(front: LLMEngine, n: int, args) -> dict:
    """Data parallelism: end-to-end throughput of N requests spread over the replicas (per-step device accounting
    and the matmul floor are per engine: run the bench on one replica's devices for those)."""
    rng = np.random.default_rng(n)
    prompts = [rng.integers(3, front.model_config.vocab_size, args.input_len).tolist() for _ in range(n)]
    _generate(front, prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "warm")
    start = time.perf_counter()
    _generate(front, prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True), "run")
    wall = time.perf_counter() - start
    out_tokens = n * args.output_len
    first = front.core.replicas[0]
    return dict(engine="jaxserve", model=args.model or args.preset, N=n, input_len=args.input_len,
                output_len=args.output_len, data_parallel_size=len(front.core.replicas),
                tensor_parallel_size=first.config.tensor_parallel_size, total_s=round(wall, 3),
                out_tok_s=round(out_tokens / wall, 1), total_tok_s=round((out_tokens + n * args.input_len) / wall, 1),
                attention=first.kernels.attention_name, device=jax.devices()[0].device_kind, host=platform.node(),
                ts=time.strftime("%Y-%m-%dT%H:%M:%S"))


def weight_matmul_floor(engine: LLMEngine, batch: int, repeats: int = 20, unstacked: bool = False) -> float:
    """Seconds for one decode step's weight matmuls alone: x[batch] through every projection of every layer and
    the LM head, through the same `dense` the model uses (so quantized weights take the same kernels).

    By default the layers are scanned over the stacked weights, as the model runs them. `unstacked` copies each
    layer's weights into arrays of their own first and unrolls the loop: on XLA:CPU, whose dots cannot read a
    dynamic slice in place, that removes the per-layer weight copies a scan makes, so it is the true floor there
    (it needs a second copy of the weights: CPU only). A MoE model is always unrolled: each layer's expert
    matmuls are sized by that layer's routing of x, fixed before compiling (bench/moe_grouped.py floor_fn)."""
    model = nnx.merge(engine.core.runner.graphdef, engine.core.runner.params)
    kernels = engine.core.kernels
    graphdef, stacked = nnx.split(model.layers)
    cfg = engine.model_config
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, cfg.hidden_size)), model.dtype)
    experts_hit = [floor_fn(np.asarray(moe.route(x, stacked["router"][...][i], cfg.num_experts_per_tok,
                                                 cfg.norm_topk_prob)[0]), cfg.num_experts)
                   for i in range(cfg.num_layers)] if cfg.is_moe else None

    def mlp_matmuls(x, layer, index):
        if cfg.is_moe:  # the router, then each expert this batch is routed to over exactly its tokens
            router = jnp.dot(x, layer.router[...], preferred_element_type=jnp.float32)
            return experts_hit[index](x, layer.we_gate[...], layer.we_up[...], layer.we_down[...]) + router.sum()
        gate, up = (dense(x, w, "te,ef->tf", kernels=kernels) for w in (layer.w_gate, layer.w_up))
        return dense(gate * up, layer.w_down, "tf,fe->te", kernels=kernels)

    def one_layer(x, layer_state, index=None):
        layer = nnx.merge(graphdef, layer_state)
        q, k, v = (dense(x, w, "te,ehd->thd", kernels=kernels) for w in (layer.wq, layer.wk, layer.wv))
        attn = dense(q, layer.wo, "thd,hde->te", kernels=kernels)
        out = x + attn + mlp_matmuls(x, layer, index) + (k.sum() + v.sum()).astype(x.dtype)
        return out.astype(x.dtype), None

    def scanned(x, stacked):
        return model.logits(jax.lax.scan(one_layer, x, stacked)[0], kernels)

    def unrolled(x, per_layer):
        for index, layer_state in enumerate(per_layer):
            x, _ = one_layer(x, layer_state, index)
        return model.logits(x, kernels)

    unstacked = unstacked or cfg.is_moe
    weights = stacked
    if unstacked:
        weights = [jax.tree.map(lambda w, i=i: jnp.array(w[i]), stacked) for i in range(cfg.num_layers)]
    fn = jax.jit(unrolled if unstacked else scanned)
    fn(x, weights).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x, weights).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_CEILINGS: dict[str, float] = {}


def machine_ceilings(dtype) -> tuple[float, float]:
    """(bytes/s one device reads, matmul FLOP/s in `dtype`), measured now, best of 5 (cached per process): a sum
    over a 256 MiB array, and a [1024, 2048] x [2048, 2048] matmul."""
    key = str(jnp.dtype(dtype))
    if key not in _CEILINGS:
        big = jnp.ones((2**26,), jnp.float32)
        a = jnp.ones((1024, 2048), dtype)
        b = jnp.ones((2048, 2048), dtype)
        read = jax.jit(lambda v: v.sum())
        mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
        _CEILINGS["read"] = big.nbytes / timed(read, big, repeats=5, summary=min)
        _CEILINGS[key] = 2 * 1024 * 2048 * 2048 / timed(mm, a, b, repeats=5, summary=min)
    return _CEILINGS["read"], _CEILINGS[key]


def _values(leaf):
    """A weight's array: a quantized weight's {"values", "scales", ...} has its values."""
    return leaf["values"] if isinstance(leaf, dict) else leaf


def _nbytes(leaf) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(leaf))


def _elements(leaf, cfg: ModelConfig) -> int:
    """The weight's element count (int4 values pack two in a byte)."""
    packed = isinstance(leaf, dict) and (cfg.quantization or "").startswith("int4")
    return _values(leaf).size * (2 if packed else 1)


def machine_copy_bandwidth(fresh: bool = False) -> float | None:
    """Bytes/s numpy copies at (read + write counted, best of 5), measured once per process unless `fresh`; None off
    a CPU backend."""
    if jax.default_backend() != "cpu":
        return None
    if fresh or "copy" not in _CEILINGS:
        _CEILINGS["copy"] = copy_bandwidth()
    return _CEILINGS["copy"]


def hardware_floor(engine: LLMEngine, batch: int) -> dict:
    """A decode step's lower bound from this machine's measured ceilings: the weight bytes it must read over the
    read bandwidth, and its weight-matmul FLOPs over the matmul rate; the larger binds. For a MoE model the bytes
    are the experts this batch is routed to (routing of a random batch, as weight_matmul_floor's) and the FLOPs
    the top-k experts' per token: all experts' weights sit in memory, only those hit are read."""
    cfg = engine.model_config
    params = nnx.to_pure_dict(engine.core.runner.params)
    layers = params["layers"]
    expert_leaves = {name for name in layers if name.startswith("we_")}
    dense_bytes = sum(_nbytes(leaf) for name, leaf in layers.items() if name not in expert_leaves)
    dense_elems = sum(_elements(leaf, cfg) for name, leaf in layers.items()
                      if name not in expert_leaves and _values(leaf).ndim > 2)
    head = params.get("lm_head", params["embed"])
    weight_bytes, flops = dense_bytes + _nbytes(head), 2 * batch * (dense_elems + _elements(head, cfg))
    if expert_leaves:
        per_expert = sum(layers[name].nbytes for name in expert_leaves) // (cfg.num_layers * cfg.num_experts)
        per_expert_elems = sum(layers[name].size for name in expert_leaves) // (cfg.num_layers * cfg.num_experts)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, cfg.hidden_size)), jnp.float32)
        hit = [len(np.unique(np.asarray(moe.route(x, layers["router"][i], cfg.num_experts_per_tok,
                                                  cfg.norm_topk_prob)[0]))) for i in range(cfg.num_layers)]
        weight_bytes += sum(hit) * per_expert
        flops += 2 * batch * cfg.num_layers * cfg.num_experts_per_tok * per_expert_elems
    read_rate, flop_rate = machine_ceilings(params["embed"].dtype)
    bytes_s, flops_s = weight_bytes / read_rate, flops / flop_rate
    copy_rate = machine_copy_bandwidth()
    return dict(floor_weight_bytes=int(weight_bytes), floor_flops=int(flops), read_gb_s=round(read_rate / 1e9, 2),
                copy_gb_s=copy_rate and round(copy_rate / 1e9, 2),
                matmul_gflop_s=round(flop_rate / 1e9, 1), hardware_floor_ms=round(max(bytes_s, flops_s) * 1e3, 3),
                floor_bound="bytes" if bytes_s >= flops_s else "flops")


def run_batch(engine: LLMEngine, n: int, args) -> dict:
    rng = np.random.default_rng(n)
    vocab = engine.model_config.vocab_size
    prompts = [rng.integers(3, vocab, args.input_len).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    _generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "warm")
    device_seconds = _device_seconds(engine, prompts, params)
    runs, host_cpu = [], 0.0  # (wall, steps, mean decode step, copy bandwidth measured right after)
    for _ in range(args.repeats):
        cpu_before = time.thread_time()
        wall, steps = _timed_run(engine, prompts, params)
        host_cpu += time.thread_time() - cpu_before
        runs.append((wall, steps, _mean_decode_step(steps), machine_copy_bandwidth(fresh=True)))
    wall, steps = sorted(runs, key=lambda run: run[0])[len(runs) // 2][:2]  # the median run
    step_time = statistics.median(run[2] for run in runs)
    floor = weight_matmul_floor(engine, n)
    floor_unstacked = weight_matmul_floor(engine, n, unstacked=True) if jax.default_backend() == "cpu" else None
    hardware = hardware_floor(engine, n)
    copies = [run[3] for run in runs if run[3]]
    if copies:  # the copies measured next to the runs
        hardware["copy_gb_s"] = round(statistics.median(copies) / 1e9, 2)
    out_tokens = n * args.output_len
    return dict(engine="jaxserve", model=args.model or args.preset,
                dtype=str(engine.core.runner.params["embed"][...].dtype),
                N=n, input_len=args.input_len, output_len=args.output_len, total_s=round(wall, 3),
                out_tok_s=round(out_tokens / wall, 1), total_tok_s=round((out_tokens + n * args.input_len) / wall, 1),
                steps=sum(s.burst for s in steps), calls=len(steps),
                mean_decode_step_ms=round(step_time * 1e3, 3), matmul_floor_ms=round(floor * 1e3, 3),
                decode_vs_floor=round(step_time / floor, 3),
                matmul_floor_unstacked_ms=floor_unstacked and round(floor_unstacked * 1e3, 3),
                decode_vs_unstacked_floor=floor_unstacked and round(step_time / floor_unstacked, 3),
                decode_step_ms_runs=[round(run[2] * 1e3, 3) for run in runs],
                **hardware, decode_vs_hardware_floor=round(step_time * 1e3 / hardware["hardware_floor_ms"], 3),
                **_achieved_bandwidth(hardware, step_time, runs),
                device_s=round(device_seconds, 3),
                host_not_overlapped_share=round(max(0.0, 1 - device_seconds / wall), 3),
                host_cpu_ms_per_step=round(host_cpu / sum(sum(s.burst for s in run[1]) for run in runs) * 1e3, 3),
                host_cpu_share=round(host_cpu / sum(run[0] for run in runs), 3),
                attention=engine.core.kernels.attention_name, device=jax.devices()[0].device_kind,
                host=platform.node(), ts=time.strftime("%Y-%m-%dT%H:%M:%S"))


def _mean_decode_step(steps) -> float:
    """The mean decode step of a timed run; a decode burst (several decode steps in one call): its time shared by
    its steps."""
    decode = [(b.done_at - a.done_at) / b.burst for a, b in zip(steps, steps[1:])
              if a.shape.kind == "decode" and b.shape.kind == "decode"]
    return statistics.mean(decode) if decode else float("nan")


def _achieved_bandwidth(hardware: dict, step_time: float, runs) -> dict:
    """The weight bytes a decode step must read over its mean time, and that as a fraction of the read bandwidth
    measured once and of the copy bandwidth measured after each run (copy: numpy's, read + write bytes counted;
    CPU only): the median of the runs' ratios, each run's mean step against the copy right after it."""
    weight_bytes = hardware["floor_weight_bytes"]
    rate = weight_bytes / step_time / 1e9
    out = dict(decode_weight_gb_s=round(rate, 2), decode_weight_bw_vs_read=round(rate / hardware["read_gb_s"], 3))
    paired = [(weight_bytes / step / 1e9, copy / 1e9) for _, _, step, copy in runs if copy]
    if paired:
        ratios = [run_rate / copy for run_rate, copy in paired]
        out.update(copy_gb_s_runs=[round(copy, 2) for _, copy in paired],
                   decode_weight_bw_vs_copy=round(statistics.median(ratios), 3),
                   decode_weight_bw_vs_copy_runs=[round(ratio, 3) for ratio in ratios])
    return out


def _timed_run(engine: LLMEngine, prompts, params):
    first_step = engine.core.stats.num_steps
    start = time.perf_counter()
    outputs = _generate(engine, prompts, params, "run")
    wall = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * params.max_tokens
    return wall, list(engine.core.stats.steps)[-(engine.core.stats.num_steps - first_step):]


def _device_seconds(engine: LLMEngine, prompts, params) -> float:
    """Device time of the workload: the same run without overlap, summing how long each step kept the host
    waiting right after its dispatch (nothing else runs meanwhile)."""
    config = engine.core.config
    engine.core.config = config.replace(async_scheduling=False)
    try:
        _, steps = _timed_run(engine, prompts, params)
    finally:
        engine.core.config = config
    return sum(s.waited for s in steps)


def _generate(engine: LLMEngine, prompts, params, tag):
    """As LLM.generate runs them: only each request's final output is built."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params, kind=OutputKind.FINAL_ONLY)
    return engine.run_until_done()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default="small",
                     help="random model of this shape (moe-*: Mixtral-style Mixture of Experts)")
    src.add_argument("--model", help="a converted jaxserve checkpoint instead of a random model")
    ap.add_argument("--dtype", default="bfloat16", help="stored weight dtype of the random model")
    ap.add_argument("--quantize", choices=["int8", "int4"], help="weight-only quantization of the random model")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each batch size (medians reported)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="devices one model is sharded over")
    ap.add_argument("--data-parallel-size", type=int, default=1, help="model replicas (end-to-end numbers only)")
    ap.add_argument("--engine-args", default="{}", help="JSON dict of extra EngineConfig fields")
    ap.add_argument("--out", help="append one JSON line per batch size to this file")
    args = ap.parse_args(argv)
    engine = build_engine(args)
    data_parallel = isinstance(engine.core, DataParallelCore)
    first = engine.core.replicas[0] if data_parallel else engine.core
    print(f"# {jax.devices()[0].device_kind}: compiled {first.runner.num_executables} executables "
          f"in {first.compile_seconds:.1f}s ({first.sharder.describe()})", file=sys.stderr)
    for n in args.batch_sizes:
        if data_parallel:
            record = run_batch_replicas(engine, n, args)
        else:
            record = {**run_batch(engine, n, args), "tensor_parallel_size": engine.core.config.tensor_parallel_size}
        emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
