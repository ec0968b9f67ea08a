#!/usr/bin/env python3
"""LoRA serving cost: output tok/s of the base model alone, of the same model serving N random adapters mixed in
every batch (--enable-lora), and of one adapter merged into the weights (--merge-lora), in one process, rounds
interleaved (base, lora, merged; then lora, merged, base; ...) so that the ratios are same-run ratios.

Workload (issue 16): `small` random Llama of ../shared/peers, 4 random rank-16 PEFT adapters on all seven
projections, 64 requests of 128 random prompt tokens + 128 generated tokens (greedy, EOS ignored), request i
running with adapter i mod 4.

    python bench/lora.py                                   # small, CPU
    python bench/lora.py --preset tiny --rounds 1          # quick
    python bench/lora.py --preset llama3-8b --dtype bfloat16 --out lora.json      # GPU (bench/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import PRESETS, preset_config  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.engine import LLMEngine, resolve_dtype  # noqa: E402
from jaxserve.lora import LoRARequest  # noqa: E402
from jaxserve.models.llama import numpy_dtype, random_model  # noqa: E402
from jaxserve.outputs import OutputKind  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapter(directory: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory with random factors on every projection (as save_pretrained lays it out)."""
    from safetensors.numpy import save_file
    e, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (q, e), "k_proj": (kv, e), "v_proj": (kv, e), "o_proj": (e, q), "gate_proj": (f, e),
              "up_proj": (f, e), "down_proj": (e, f)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (out, inp) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, inp)) * 0.02).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.02).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}))
    return directory


def run_once(engine: LLMEngine, prompts, params, adapters, tag: str) -> float:
    """Output tok/s of every prompt at once, request i with adapters[i % len(adapters)]."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params, kind=OutputKind.FINAL_ONLY,
                           lora_request=adapters[i % len(adapters)])
    outputs = engine.run_until_done()
    wall = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * params.max_tokens
    return len(prompts) * params.max_tokens / wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--dtype", default="bfloat16", help="stored weight dtype of the random model")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds of base, lora, merged (order rotating)")
    ap.add_argument("--engine-args", default="{}", help="JSON of extra EngineConfig fields")
    ap.add_argument("--out", help="append the result as one JSON line to this file")
    args = ap.parse_args(argv)

    cfg = preset_config(args.preset, args.dtype)
    n = args.num_requests
    config = EngineConfig(**{**dict(max_num_seqs=n, max_num_batched_tokens=2048, max_model_len=args.input_len +
                                    args.output_len, kv_cache_memory=float(2**29)), **json.loads(args.engine_args)})
    model = random_model(cfg, numpy_dtype(resolve_dtype(config.dtype, args.dtype)), seed=0)
    directory = Path(tempfile.mkdtemp(prefix="jaxserve-lora-bench-"))
    paths = [write_random_adapter(directory / f"a{i}", cfg, args.rank, seed=i) for i in range(args.adapters)]
    modules = tuple(f"a{i}={p}" for i, p in enumerate(paths))
    engines = {
        "base": (LLMEngine(model, config, show_progress=False), [None]),
        "lora": (LLMEngine(model, config.replace(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                                                 lora_modules=modules), show_progress=False),
                 [LoRARequest(f"a{i}", i + 1) for i in range(args.adapters)]),
        "merged": (LLMEngine(model, config.replace(merge_lora=True, lora_modules=modules[:1]), show_progress=False),
                   [LoRARequest("a0", 1)]),
    }
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, args.input_len).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for name, (engine, adapters) in engines.items():  # every executable the timed runs use runs once before
        run_once(engine, prompts, warm, adapters, f"warm-{name}")
        run_once(engine, prompts, params, adapters, f"warm-full-{name}")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:  # the order rotates: no engine always runs first or last
            engine, adapters = engines[name]
            rates[name].append(run_once(engine, prompts, params, adapters, f"r{r}-{name}"))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()) + " out tok/s", flush=True)
    ratios = {name: [v / b for v, b in zip(rates[name], rates["base"])] for name in ("lora", "merged")}
    result = dict(preset=args.preset, dtype=str(engines["base"][0].core.runner.params["embed"][...].dtype),
                  adapters=args.adapters, rank=args.rank, N=n, input_len=args.input_len, output_len=args.output_len,
                  out_tok_s={k: [round(x, 1) for x in v] for k, v in rates.items()},
                  lora_vs_base=[round(x, 3) for x in ratios["lora"]],
                  merged_vs_base=[round(x, 3) for x in ratios["merged"]],
                  lora_vs_base_median=round(statistics.median(ratios["lora"]), 3),
                  merged_vs_base_median=round(statistics.median(ratios["merged"]), 3),
                  attention=engines["base"][0].core.kernels.attention_name, device=jax.devices()[0].device_kind,
                  host=platform.node(), ts=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
