"""`jaxserve estimate`: memory and speed of a model on a GPU from its config alone, before anything is loaded.

    jaxserve estimate --model checkpoints/demo --gpu h100
    jaxserve estimate --model path/to/config.json --quantize int4 --kv-cache-dtype int8 --gpu l4
    jaxserve estimate --model DIR --memory-gb 40 --max-model-len 32768 --tensor-parallel-size 2 --json

Memory follows what the engine does at start-up (jaxserve.engine.memory.plan_kv_cache, the same function):

    device memory x XLA pool fraction (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default)   = the pool
    pool - weights - slot state (token history, sampling state)                            = free
    the largest step's temporaries: --measure compiles the engine's largest step shapes on
        this machine from abstract weights (the engine's own measurement), else estimated  = temporaries
    free x kv_cache_fraction (0.9) - temporaries - margin, or --kv-cache-memory, in pages  = the KV cache

Speed floors are rooflines on the GPU's datasheet figures (jaxserve.observability.gpus): a decode step reads every
weight once plus each sequence's KV; a prefill token costs 2 FLOPs per matmul parameter plus attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Collection
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ConfigError, EngineConfig, ModelConfig, env_str, model_config_from_hf
from jaxserve.convert import quantized
from jaxserve.engine.buckets import engine_buckets
from jaxserve.engine.memory import KVPlan, plan_kv_cache, wanted_pages
from jaxserve.engine.placement import abstract_on_mesh, engine_mesh, kept_weights, kv_cache_shardings, model_sharder
from jaxserve.engine.sampler import SlotState
from jaxserve.kv.cache import CACHE_AXES, KVCache
from jaxserve.models.llama import abstract_model, abstract_weights, numpy_dtype
from jaxserve.observability.cost import ModelCost
from jaxserve.observability.gpus import GPUS, GiB, GpuSpec
from jaxserve.parallel.sharding import DATA, MODEL, divisible_rules
from jaxserve.quant import kv as kv_quant
from jaxserve.quant import schemes
from jaxserve.quant.memory import kv_bytes_per_token

DEFAULT_POOL_FRACTION = 0.75  # XLA's default GPU preallocation: 75% of the device's memory (JAX docs, GPU memory
# allocation: "preallocate 75% of the total GPU memory"; XLA_PYTHON_CLIENT_MEM_FRACTION overrides it)
RULE_OF_THUMB_OVERHEAD = 1.2


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device."""

    device: int
    pool: int
    weights: int
    slots: int  # the slot state: token history and sampling state of max_num_seqs + 1 slots
    free: int  # pool - weights - slots
    temporaries: int  # the largest step executable's transient bytes (measured, or estimated)
    temporaries_measured: bool  # compiled on this machine (--measure), or the analytic estimate
    kv_cache: int  # the plan's pages x bytes per page (0 when not even one sequence fits)
    kv_bytes_per_token: int  # per device (a tensor-parallel device holds its share of the KV heads)
    reserve: int  # free - kv_cache: temporaries, margin and what kv_cache_fraction leaves unused
    plan: KVPlan | None
    error: str | None  # why nothing fits
    adapters: int = 0  # LoRA adapter slots (--enable-lora): max_loras + 1 slots of max_lora_rank factors

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds (the engine caps pages at max_num_seqs full-length sequences)."""
        return self.plan.max_tokens if self.plan else 0

    @property
    def budget_tokens(self) -> int:
        """Tokens the KV budget would hold without that cap."""
        return max(0, self.kv_budget // self.plan.bytes_per_page - 1) * self.plan.page_size if self.plan else 0

    @property
    def kv_budget(self) -> int:
        return self.plan.budget_bytes if self.plan else 0


@dataclasses.dataclass(frozen=True)
class Estimate:
    model: ModelConfig
    engine: EngineConfig
    max_model_len: int
    weight_dtype: str
    kv_dtype: str  # the cache's element type
    kv_bytes_per_token: int  # all devices together, scales included
    tensor_parallel_size: int
    gpu: GpuSpec | None
    memory: MemoryEstimate
    params: int
    rule_of_thumb: float  # params x bits/8 x 1.2, bytes (all devices)
    kept: tuple[str, ...] = ()  # weights kept in the checkpoint's dtype (kept_in_storage)

    @property
    def concurrent_sequences(self) -> int:
        """Sequences of max_model_len tokens the KV budget holds at once (before the max_num_seqs cap)."""
        if self.memory.plan is None:
            return 0
        pages = math.ceil(self.max_model_len / self.engine.page_size)
        return max(0, self.memory.kv_budget // self.memory.plan.bytes_per_page - 1) // pages

    def floors(self) -> dict | None:
        """Roofline floors per token on the GPU (None without a --gpu)."""
        if self.gpu is None:
            return None
        tp, bw, flops = self.tensor_parallel_size, self.gpu.bandwidth, self.gpu.bf16_flops
        cost = ModelCost.of(self.model, self.weight_dtype, self.kv_bytes_per_token, tp)
        ctx = self.max_model_len
        batch = max(1, min(self.concurrent_sequences, self.engine.max_num_seqs))
        decode_1 = cost.work(1, 1, 1, ctx, ctx)
        decode_b = cost.work(1, batch, batch, batch * ctx, batch * ctx)
        prefill = cost.work(0, ctx, 1, 0, ctx * (ctx + 1) // 2)
        return {
            "decode_batch1_s": max(decode_1.bytes / (tp * bw), decode_1.flops / (tp * flops)),
            "decode_batch": batch,
            "decode_batch_step_s": max(decode_b.bytes / (tp * bw), decode_b.flops / (tp * flops)),
            "prefill_s_per_token": max(prefill.bytes / (tp * bw), prefill.flops / (tp * flops)) / ctx,
            "prefill_matmul_s_per_token": 2 * cost.matmul_params / (tp * flops),
            "weights_read_s": cost.weights_read(1, 1) / (tp * bw),
        }

    def as_dict(self) -> dict:
        m = self.memory
        return {
            "params": self.params, "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype,
            "max_model_len": self.max_model_len, "tensor_parallel_size": self.tensor_parallel_size,
            "gpu": self.gpu.name if self.gpu else None,
            "memory_per_device": {"device": m.device, "pool": m.pool, "weights": m.weights, "slots": m.slots,
                                  "lora_adapters": m.adapters,
                                  "free": m.free, "temporaries": m.temporaries,
                                  "temporaries_measured": m.temporaries_measured,
                                  "margin": m.plan.margin if m.plan else 0, "kv_budget": m.kv_budget,
                                  "kv_cache": m.kv_cache, "reserve": m.reserve},
            "kv_bytes_per_token": m.kv_bytes_per_token, "kv_pages": m.plan.num_pages if m.plan else 0,
            "kv_tokens": m.kv_tokens, "budget_tokens": m.budget_tokens,
            "concurrent_sequences": self.concurrent_sequences, "rule_of_thumb_bytes": self.rule_of_thumb,
            "floors": self.floors(), "error": m.error,
        }


# ---- the arithmetic ---------------------------------------------------------------------------------------------
def estimate(cfg: ModelConfig, engine: EngineConfig = EngineConfig(), *, memory_bytes: int,
             gpu: GpuSpec | None = None, weight_dtype: str | None = None,
             pool_fraction: float = DEFAULT_POOL_FRACTION, measure: bool = False,
             temporaries: int | None = None) -> Estimate:
    """The estimate for `cfg` (quantization as cfg says) on a device of `memory_bytes`, of which XLA's allocator
    gets `pool_fraction`. `measure`: compile the largest step shapes on this machine's backend (as the engine
    does before sizing its cache) instead of estimating their temporaries; `temporaries`: a figure measured
    before (measure_temporaries) for this model and engine config."""
    dtype = weight_dtype or cfg.dtype
    max_len = engine.resolved_max_model_len(cfg)
    tp = engine.tensor_parallel_size
    kv_dtype = jnp.dtype(kv_quant.kv_storage_dtype(engine.kv_cache_dtype, dtype))
    kept_paths = kept_weights(cfg, engine, dtype) if gpu is None else ()
    arrays = weight_arrays(cfg, dtype, kept_paths)
    kept = sharded_axes(cfg, arrays, tp)
    kv_shards = tp if "kv_heads" in kept else 1
    weights = bytes_per_device(arrays, kept, tp)
    pool = int(memory_bytes * pool_fraction)
    slots = slot_state_bytes(engine, max_len)
    adapters = bytes_per_device(adapter_arrays(cfg, engine, dtype), kept, tp) if engine.enable_lora else 0
    free = pool - weights - slots - adapters
    measured = measure or temporaries is not None
    if temporaries is None:
        temporaries = (measure_temporaries(cfg, engine, dtype) if measure
                       else activation_bytes(cfg, engine, max_len, jnp.dtype(dtype).itemsize, tp))
    plan, error = None, None
    try:
        if free <= 0:
            raise MemoryError(f"the weights ({weights / GiB:.1f} GiB per device) do not fit in the "
                              f"{pool / GiB:.1f} GiB XLA pool")
        plan = plan_kv_cache(cfg, engine, max_len, kv_dtype, free, temporaries, kv_shards=kv_shards)
    except MemoryError as exc:
        error = str(exc)
    kv_cache = plan.cache_bytes if plan else 0
    kv_per_token = kv_bytes_per_token(cfg, "auto", kv_dtype)
    memory = MemoryEstimate(memory_bytes, pool, weights, slots, free, temporaries, measured, kv_cache,
                            kv_per_token // kv_shards, max(0, free - kv_cache), plan, error, adapters)
    params = cfg.num_params()
    return Estimate(cfg, engine, max_len, dtype, kv_dtype.name, kv_per_token, tp, gpu, memory, params,
                    params * schemes_bits(cfg, dtype) / 8 * RULE_OF_THUMB_OVERHEAD, kept_paths)


def slot_state_bytes(engine: EngineConfig, max_len: int) -> int:
    """The engine's slot state (replicated on every device), from its shapes."""
    shapes = jax.eval_shape(lambda: SlotState.zeros(engine.max_num_seqs + 1, max_len))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


class _AbstractWeight(jax.ShapeDtypeStruct):
    """A weight's shape, dtype and sharding; reading it whole (`variable[...]`) gives itself back."""

    def __getitem__(self, index):
        return self


def measure_temporaries(cfg: ModelConfig, engine: EngineConfig, dtype: str) -> int:
    """The engine's own measurement (ModelRunner.measure_transients on its largest step shapes, against the
    largest cache it would allocate), made on this machine's backend from abstract weights: nothing is allocated.
    On another backend than the target's, this is the XLA of this machine's figure."""
    runner = abstract_runner(cfg, engine, dtype)
    return runner.measure_transients(runner.buckets.largest_shapes())


def abstract_runner(cfg: ModelConfig, engine: EngineConfig, dtype: str):
    """The ModelRunner an engine with this config would build (its kernels, buckets, shardings, and the largest cache
    it would allocate), over abstract weights and caches: it lowers and compiles step shapes, nothing is allocated."""
    from jaxserve.engine.runner import ModelRunner
    from jaxserve.models.kernels import Kernels
    max_len = engine.resolved_max_model_len(cfg)
    np_dtype = numpy_dtype(dtype)
    kv_dtype = kv_quant.kv_storage_dtype(engine.kv_cache_dtype, np_dtype)
    kernels = Kernels.resolve(engine.attention, engine.matmul, kv_dtype)
    sharder = model_sharder(cfg, engine_mesh(engine), np_dtype)
    graphdef, state = nnx.split(abstract_model(cfg, np_dtype))

    def placed(var: nnx.Variable) -> nnx.Variable:
        value = var.get_value()
        return var.replace(_AbstractWeight(value.shape, value.dtype,
                                           sharding=sharder.sharding(var.get_metadata().get("axes", ()))))

    model = nnx.merge(graphdef, jax.tree.map(placed, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    kv = abstract_on_mesh(lambda: KVCache.zeros(cfg.num_layers, cfg.num_kv_heads, wanted_pages(engine, max_len),
                                                engine.page_size, cfg.head_dim, kv_dtype),
                          lambda a: kv_cache_shardings(a, sharder))
    slots = abstract_on_mesh(lambda: SlotState.zeros(engine.max_num_seqs + 1, max_len), lambda a: sharder.replicated)
    buckets = engine_buckets(engine, max_len, kernels.attention_name)
    options = ({"xla_backend_optimization_level": engine.xla_optimization_level}
               if engine.xla_optimization_level is not None else None)
    return ModelRunner(model, kv, slots, buckets, kernels, options, sharder)


def weight_arrays(cfg: ModelConfig, dtype: str, keep_stored: Collection[str] = ()
                  ) -> list[tuple[tuple, tuple[int, ...], jnp.dtype]]:
    """(logical axes, shape, dtype) of every stored weight array, quantized values and scales included, from the
    model's declaration traced abstractly (nothing is allocated); keep_stored as load_model's."""
    _, state = abstract_weights(cfg, numpy_dtype(dtype), keep_stored)
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(tuple(v.get_metadata()["axes"]), tuple(v.get_value().shape), jnp.dtype(v.get_value().dtype))
            for v in leaves]


def adapter_arrays(cfg: ModelConfig, engine: EngineConfig, dtype: str
                   ) -> list[tuple[tuple, tuple[int, ...], jnp.dtype]]:
    """(logical axes, shape, dtype) of the stacked LoRA factors --enable-lora adds (jaxserve.lora.weights)."""
    from jaxserve.lora.weights import LoraWeights
    abstract = nnx.eval_shape(lambda: LoraWeights(cfg, engine.max_loras, engine.max_lora_rank, numpy_dtype(dtype)))
    _, state = nnx.split(abstract, nnx.Param)
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(tuple(v.get_metadata()["axes"]), tuple(v.get_value().shape), jnp.dtype(v.get_value().dtype))
            for v in leaves]


def sharded_axes(cfg: ModelConfig, arrays, tp: int) -> frozenset[str]:
    """The logical axes tensor parallelism splits for this model: jaxserve.parallel's rules minus those some weight
    or the KV cache cannot divide (what engine.placement.model_sharder resolves on a real mesh)."""
    shapes = [(axes, shape) for axes, shape, _ in arrays] + [(CACHE_AXES[:2], (cfg.num_layers, cfg.num_kv_heads))]
    return frozenset(divisible_rules(shapes, {DATA: 1, MODEL: tp}))


def bytes_per_device(arrays, kept: frozenset[str], tp: int) -> int:
    """A weight with a split logical axis holds 1/tp of itself on each device (the mesh axis splits one dim)."""
    return sum(math.prod(shape) * dtype.itemsize // (tp if kept.intersection(axes) else 1)
               for axes, shape, dtype in arrays)


def activation_bytes(cfg: ModelConfig, engine: EngineConfig, max_len: int, itemsize: int, tp: int = 1) -> int:
    """Rough transient bytes of the largest step when they cannot be measured (max_num_batched_tokens tokens, one
    layer live under the scan, paged attention reading pages in place): hidden states, q/k/v and attention
    output, MLP intermediates, float32 logits and sampling buffers for the step's sequences."""
    t = engine.max_num_batched_tokens
    s = min(t, engine.max_num_seqs)
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    routed = max(1, cfg.num_experts_per_tok)  # a MoE token's intermediates: one gated MLP per routed expert
    per_token = 2 * e + (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * d // tp + 3 * f * routed // tp
    logits = 3 * s * cfg.vocab_size * 4
    return 2 * t * per_token * itemsize + logits  # x2: XLA keeps a step's inputs and outputs live at once


def schemes_bits(cfg: ModelConfig, dtype: str) -> float:
    """Bits per parameter the rule of thumb uses: the decoder's scheme (8 for int8 / fp8, 4 for int4), else the
    float dtype's."""
    if cfg.quantization is None:
        return 8 * jnp.dtype(dtype).itemsize
    return 4 if schemes.parse(cfg.quantization).kind == "int4" else 8


# ---- the command --------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR|CONFIG.json",
                        help="a jaxserve checkpoint, a Hugging Face model directory, or either's config file")
    parser.add_argument("--quantize", choices=schemes.SCHEMES, default=None,
                        help="weight-only quantization of the decoder projections (as `convert --quantize`)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *kv_quant.KV_CACHE_DTYPES))
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="float weight dtype (default: the checkpoint's)")
    parser.add_argument("--max-model-len", type=int, default=None)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--gpu", choices=sorted(GPUS), help="a GPU from its datasheet")
    target.add_argument("--memory-gb", type=float, help="device memory in GiB (no speed floors)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    parser.add_argument("--page-size", type=int, default=EngineConfig.page_size)
    parser.add_argument("--kv-cache-fraction", type=float, default=EngineConfig.kv_cache_fraction)
    parser.add_argument("--kv-cache-memory", type=float, default=None, help="bytes for the KV cache")
    parser.add_argument("--pool-fraction", type=float, default=None,
                        help="share of device memory XLA's allocator takes (default: $XLA_PYTHON_CLIENT_MEM_FRACTION, "
                             f"else {DEFAULT_POOL_FRACTION})")
    parser.add_argument("--measure", action="store_true",
                        help="compile the engine's largest step shapes on this machine (from abstract weights, "
                             "nothing allocated) and reserve their measured temporaries, as the engine does, instead "
                             "of estimating them; exact for this machine's backend")
    parser.add_argument("--enable-lora", action="store_true", help="reserve LoRA adapter slots (as `serve`)")
    parser.add_argument("--max-loras", type=int, default=EngineConfig.max_loras)
    parser.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank)
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_model_config(args.model)
        if args.quantize:
            cfg = dataclasses.replace(cfg, quantization=args.quantize)
        engine = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                              kv_cache_fraction=args.kv_cache_fraction, kv_cache_memory=args.kv_cache_memory,
                              kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
                              enable_lora=args.enable_lora, max_loras=args.max_loras,
                              max_lora_rank=args.max_lora_rank)
        gpu = GPUS[args.gpu] if args.gpu else None
        memory = gpu.memory_bytes if gpu else int(args.memory_gb * GiB)
        result = estimate(cfg, engine, memory_bytes=memory, gpu=gpu, weight_dtype=args.dtype,
                          pool_fraction=args.pool_fraction or float(env_str("XLA_PYTHON_CLIENT_MEM_FRACTION")
                                                                    or DEFAULT_POOL_FRACTION), measure=args.measure)
    except (ConfigError, schemes.QuantizationError, FileNotFoundError, ValueError) as exc:
        print(f"jaxserve estimate: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.as_dict(), indent=2) if args.json else report(result))
    return 0 if result.memory.error is None else 1


def load_model_config(path: str | Path) -> ModelConfig:
    """A jaxserve checkpoint or its jaxserve.json, or a Hugging Face directory or its config.json."""
    path = Path(path)
    if path.is_dir():
        path = path / "jaxserve.json" if (path / "jaxserve.json").exists() else path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file (give a model directory or its config file)")
    data = json.loads(path.read_text())
    if "model" in data and "architecture" in data["model"]:
        return ModelConfig.from_json(data["model"])
    return imported_quantization(model_config_from_hf(data), data, path)


def imported_quantization(cfg: ModelConfig, hf_config: dict, path: Path) -> ModelConfig:
    """A quantized Hugging Face checkpoint's config with the scheme `jaxserve convert` would import it as."""
    scheme = quantized.scheme_from_config(hf_config, path)
    return cfg if scheme is None else dataclasses.replace(cfg, quantization=scheme[0], lm_head_quantization=scheme[1])


# ---- the report -------------------------------------------------------------------------------------------------
def report(e: Estimate) -> str:
    cfg, m = e.model, e.memory
    active = (f" ({cfg.num_params(active=True) / 1e9:.3g}B active: {cfg.num_experts_per_tok} of {cfg.num_experts} "
              f"experts per token)" if cfg.is_moe else "")
    lines = [f"{cfg.architecture}: {e.params / 1e9:.3g}B parameters{active}, {cfg.num_layers} layers, hidden "
             f"{cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads x {cfg.head_dim}; weights "
             f"{cfg.quantization or e.weight_dtype}{f' (projections stored {cfg.dtype})' if e.kept else ''}, KV "
             f"cache {e.kv_dtype}, max_model_len {e.max_model_len:,}",
             _target(e), "", "memory per device" + " " * 33 + "GiB"]
    rows = [("device memory", m.device, ""),
            ("XLA pool", m.pool, f"{m.pool / m.device:.0%} of the device"),
            ("weights", m.weights, f"/{e.tensor_parallel_size} devices" if e.tensor_parallel_size > 1 else ""),
            ("slot state", m.slots, "token history and sampling state"),
            *([("LoRA adapter slots", m.adapters, f"{e.engine.max_loras} adapters of rank "
                f"{e.engine.max_lora_rank} (+ the empty slot 0)")] if m.adapters else []),
            ("free after the weights and slots", m.free, ""),
            ("step temporaries", m.temporaries, ("measured on this machine" if m.temporaries_measured
                                                  else "estimated (--measure compiles them)")
             + (f", + {m.plan.margin / GiB:.2f} GiB margin" if m.plan else "")),
            ("KV cache", m.kv_cache, f"{m.kv_tokens:,} tokens in {m.plan.num_pages - 1:,} pages of "
             f"{m.plan.page_size}" if m.plan else "none"),
            ("left unused", max(0, m.reserve - m.temporaries - (m.plan.margin if m.plan else 0)),
             f"what --kv-cache-fraction keeps back ({1 - e.engine.kv_cache_fraction:.0%} of free) or the cache "
             "at max_num_seqs full sequences does not need"),
            ("outside the XLA pool", m.device - m.pool, "CUDA context, other processes")]
    lines += [f"  {name:<44}{value / GiB:>8.2f}   {note}".rstrip() for name, value, note in rows]
    lines += ["", f"KV cache: {_size(m.kv_bytes_per_token)} per token per device (2 x {cfg.num_layers} layers x "
              f"{cfg.num_kv_heads} KV heads x {cfg.head_dim} x {e.kv_dtype})"]
    if m.error:
        lines += [f"does not fit: {m.error}"]
    else:
        capped = min(e.concurrent_sequences, e.engine.max_num_seqs)
        lines += [f"concurrent sequences at {e.max_model_len:,} tokens: {e.concurrent_sequences:,} "
                  f"(the engine runs at most max_num_seqs {e.engine.max_num_seqs} at once: {capped})"]
    lines += _floor_lines(e) + _rule_of_thumb_lines(e)
    return "\n".join(lines)


def _target(e: Estimate) -> str:
    tp = f" x {e.tensor_parallel_size} (tensor parallel)" if e.tensor_parallel_size > 1 else ""
    if e.gpu is None:
        return f"on a device of {e.memory.device / GiB:.1f} GiB{tp}"
    g = e.gpu
    return (f"on {g.name}{tp}: {g.memory_bytes / GiB:.0f} GiB, {g.bandwidth / 1e12:.2f} TB/s, "
            f"{g.bf16_flops / 1e12:.0f} TFLOP/s dense BF16 (datasheet)")


def _floor_lines(e: Estimate) -> list[str]:
    f = e.floors()
    if f is None:
        return []
    b = f["decode_batch"]
    return ["", f"floors on {e.gpu.name} (rooflines: real steps are slower; no communication counted)",
            f"  decode, batch 1, {e.max_model_len:,}-token context: {_seconds(f['decode_batch1_s'])}/token "
            f"(reading the weights alone: {_seconds(f['weights_read_s'])}), at most "
            f"{1 / f['decode_batch1_s']:,.0f} tokens/s",
            f"  decode, batch {b} (the cache full at that context): {_seconds(f['decode_batch_step_s'])}/step, "
            f"at most {b / f['decode_batch_step_s']:,.0f} tokens/s",
            f"  prefill of {e.max_model_len:,} tokens: {_seconds(f['prefill_s_per_token'])}/token (the matmuls "
            f"alone: {_seconds(f['prefill_matmul_s_per_token'])}), at most {1 / f['prefill_s_per_token']:,.0f} "
            f"tokens/s"]


def _rule_of_thumb_lines(e: Estimate) -> list[str]:
    m, tp = e.memory, e.tensor_parallel_size
    bits = schemes_bits(e.model, e.weight_dtype)
    weights_all = m.weights * tp
    one_seq = e.max_model_len * e.kv_bytes_per_token
    return ["", f"rule of thumb: params x bits/8 x 1.2 = {e.params / 1e9:.3g}B x {bits:g}/8 x 1.2 = "
            f"{_size(e.rule_of_thumb)}",
            f"  it is the weights ({_size(weights_all)} stored here) plus 20% for everything else. Right for one "
            f"short request: one {e.max_model_len:,}-token sequence's KV is {_size(one_seq)}.",
            "  Wrong as a serving budget: the KV cache grows with context x concurrency and usually dwarfs the "
            f"20% (here {_size(m.kv_cache * tp)} across devices), and jaxserve, like vLLM, gives the KV cache all "
            "the memory that is left, so the question is how many tokens fit, not whether the model does.",
            "  Also: quantized weights carry float32 scales and float embeddings (bits/8 is low for int4); GQA "
            "shrinks the KV cache by heads/KV heads; XLA takes only its pool fraction of the device."]


def _seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
