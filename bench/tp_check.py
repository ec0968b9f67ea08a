#!/usr/bin/env python3
"""Tensor parallelism on real devices: greedy tokens of one random model on 1 device and on N, with the chosen
attention path (Pallas on GPU runs its kernels under shard_map over KV heads), plus each engine's decode step time.

    python bench/tp_check.py --tensor-parallel-size 2            # GPUs: prints one JSON line, exit 1 on mismatch
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python bench/tp_check.py --preset tiny --dtype float32

Greedy tokens can legitimately differ in bfloat16 where two logits tie within rounding (the tensor-parallel sums
add in another order); the report gives the first differing position per prompt, so a mismatch after many equal
tokens reads differently from one at the first token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from offline_throughput import PRESETS, preset_config  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.engine import LLMEngine  # noqa: E402
from jaxserve.models.llama import numpy_dtype, random_model  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402


def greedy(engine: LLMEngine, prompts, new_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"w{i}", p, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.run_until_done()
    first = engine.core.stats.num_steps
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    finals = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()}
    steps = list(engine.core.stats.steps)[-(engine.core.stats.num_steps - first):]
    decode = [b.done_at - a.done_at for a, b in zip(steps, steps[1:]) if b.shape.kind == "decode"]
    return [finals[str(i)] for i in range(len(prompts))], float(np.median(decode)) if decode else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensor-parallel-size", type=int, default=jax.device_count())
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    cfg = preset_config(args.preset, args.dtype)
    model = random_model(cfg, numpy_dtype(args.dtype), seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, args.input_len).tolist() for _ in range(args.batch)]
    config = EngineConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(256, args.input_len),
                          max_model_len=args.input_len + args.new_tokens + 8, attention=args.attention,
                          decode_buckets=(args.batch,), kv_cache_memory=2**28)
    record = {"device": jax.devices()[0].device_kind, "devices": jax.device_count(), "preset": args.preset,
              "dtype": args.dtype}
    tokens = {}
    for tp in (1, args.tensor_parallel_size):
        start = time.perf_counter()
        engine = LLMEngine(model, config.replace(tensor_parallel_size=tp), show_progress=False)
        tokens[tp], step = greedy(engine, prompts, args.new_tokens)
        record[f"tp{tp}"] = {"mesh": engine.core.sharder.describe(), "attention": engine.core.kernels.attention_name,
                             "decode_step_ms": round(step * 1e3, 3), "seconds": round(time.perf_counter() - start, 1)}
        del engine
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                  for x, y in zip(tokens[1], tokens[args.tensor_parallel_size])]
    record["equal"] = tokens[1] == tokens[args.tensor_parallel_size]
    record["first_difference"] = first_diff
    print(json.dumps(record), flush=True)
    return 0 if record["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
