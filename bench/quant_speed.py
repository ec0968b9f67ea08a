#!/usr/bin/env python3
"""Speed of weight-only quantization on a GPU: the W8A16 / W4A16 / WFP8A16 Pallas matmul (with zero points,
act-order and fp8 groups: the imported formats) against the bfloat16 XLA dot and Hopper's native FP8 dot, and
end-to-end decode tokens/s of the engine per scheme.

    python bench/quant_speed.py --out quant.json                 # matmul rows + end-to-end (a GPU)
    python bench/quant_speed.py --only sweep                     # launch-config sweep at M = 16
    python bench/quant_speed.py --smoke --out q.json             # tiny shapes, interpret mode, any machine
    python bench/quant_speed.py --summarize a.json b.json --markdown QUANT.md    # tables from saved runs

Matmul rows: M = 1, 16, 64, 256 tokens through the Llama-3-8B MLP shapes K x N = 4096 x 14336 (gate/up) and
14336 x 4096 (down), bfloat16 activations and output. Each timing chains `chain` dependent calls inside one jit
(each call's output perturbs the next call's input), cycling through enough copies of the weight that they do
not fit in L2 (an int4 4096 x 14336 weight is 29 MB; H200's L2 is 50 MB). Reported: microseconds per call,
speed-up over the bfloat16 dot, and weight bytes read per second as a fraction of the measured copy bandwidth.

End to end: a random Llama-3-8B-shaped model (bfloat16; then int8, int4 and int8 + int8 KV), one sequence of
--input-len prompt tokens decoding --output-len tokens; decode tokens/s is 1 / the mean interval between decode
steps (engine.core.stats), with attention and matmul on "auto" (Pallas on a GPU).

Targets (issue 6): W8A16 >= 1.7x the bfloat16 dot at M <= 16; batch-1 decode with int8 weights >= 1.6x bfloat16.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout

from jaxserve.models.linear import gather_columns  # noqa: E402
from jaxserve.quant import schemes  # noqa: E402
from jaxserve.observability.ceilings import ProbeSize, measure_copy_bandwidth  # noqa: E402
from pallas_kernels import quant_matmul as qm  # noqa: E402

TARGETS = dict(w8a16_speedup_m16=1.7, e2e_int8_speedup_batch1=1.6)
L2_BYTES = 50 * 2**20


@dataclasses.dataclass(frozen=True)
class Setup:
    ms: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...]  # (K, N)
    chain: int
    reps: int
    interpret: bool
    copy_bytes: int
    compiler_options: dict | None = None


GPU = Setup((1, 16, 64, 256), ((4096, 14336), (14336, 4096)), 12, 5, False, 2**31)
SMOKE = Setup((3,), ((256, 128),), 2, 1, True, 2**22, {"xla_backend_optimization_level": 0})


def copy_bandwidth(setup: Setup) -> float:
    """Bytes per second of an in-place elementwise pass: the probe the engine's metrics use for its ceiling."""
    size = ProbeSize(setup.copy_bytes, copy_passes=8 if jax.default_backend() == "gpu" else 1, matmul_n=0,
                     repeats=max(3, setup.reps))
    return measure_copy_bandwidth(jax.devices()[0], size)


def chained_seconds(fn, x, weights: list, setup: Setup) -> float:
    """Median seconds per call of `chain` dependent calls fn(x, *weights[i % copies]) in one jit."""
    def run(x, weights):
        for i in range(setup.chain):
            out = fn(x, *weights[i % len(weights)])
            x = x + (out[:, :1] * 1e-30).astype(x.dtype)  # a data dependency; numerically a no-op
        return x

    compiled = jax.jit(run, compiler_options=setup.compiler_options)
    jax.block_until_ready(compiled(x, weights))
    times = []
    for _ in range(setup.reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(x, weights))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / setup.chain


def weight_copies(make, nbytes: int, setup: Setup) -> list:
    """Enough copies of a weight (make(i) -> tuple of arrays) that one chained pass reads >= 3x L2."""
    count = 1 if setup.interpret else max(1, -(-3 * L2_BYTES // nbytes))
    return [make(i) for i in range(min(count, setup.chain))]


# Kernel rows per scheme (jaxserve.quant.schemes names): the formats `--quantize` writes and the imported ones
# (zero points, act-order, fp8 per channel and in 128-row groups).
MAIN_IMPLS = ("bf16_dot", "w8a16_pallas", "w4a16_pallas", "w8a16_xla", "w4a16_xla")
KERNEL_ROWS = {"w8a16": "int8", "w4a16": "int4", "w4a16_zp": "int4-g128-zp", "w4a16_zp_act": "int4-g128-zp-act",
               "w8a16_zp": "int8-g128-zp", "wfp8a16": "fp8", "wfp8a16_g128": "fp8-g128"}


def impls(k: int, n: int, setup: Setup, rows: tuple[str, ...] | None = None) -> dict:
    """name -> (fn(x, *weight), make_weight(i), weight bytes)."""
    def random_weight(i):
        return jax.random.normal(jax.random.key(i), (k, n), jnp.float32) * 0.02

    def quantized(scheme):
        quantize = jax.jit(lambda i: schemes.quantize(random_weight(i), 1, scheme))
        return lambda i: quantize(i)

    out = {"bf16_dot": (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
                        lambda i: (random_weight(i).astype(jnp.bfloat16),), 2 * k * n)}
    for row, scheme in KERNEL_ROWS.items():
        if rows is not None and row not in rows:
            continue
        nbytes = schemes.layout((k, n), ("embed", "mlp"), 1, scheme).nbytes
        out[f"{row}_pallas"] = (functools.partial(_pallas_call, scheme=scheme, interpret=setup.interpret),
                                quantized(scheme), nbytes)
        out[f"{row}_xla"] = (functools.partial(_xla_call, scheme=scheme), quantized(scheme), nbytes)
    if (rows is None or "wfp8a16" in rows) and not setup.interpret:  # a GPU's FP8 tensor cores
        out["wfp8afp8_xla_dot"] = (_native_fp8_dot, quantized("fp8"), k * n + 4 * n)
    return out


def _act_order(x, arrays, scheme):
    """(x with act-order's column gather applied, the arrays the matmul takes)."""
    if schemes.parse(scheme).act_order:
        *arrays, perm = arrays
        x = gather_columns(x, perm)
    return x, arrays


def _pallas_call(x, *arrays, scheme, interpret):
    x, arrays = _act_order(x, arrays, scheme)
    return qm.quant_matmul(x, *arrays, scheme=schemes.parse(scheme).kind, out_dtype=x.dtype, interpret=interpret)


def _xla_call(x, *arrays, scheme):
    x, (values, scales, *zeros) = _act_order(x, arrays, scheme)
    return schemes.xla_matmul(x, values, scales, scheme, *zeros).astype(x.dtype)


def _native_fp8_dot(x, values, scales):
    """Hopper's FP8 tensor-core dot (XLA: cuBLASLt): x quantized to e4m3 per tensor on the fly (W8A8; the
    numerics differ from the weight-only path: this row is the speed bound FP8 activations would buy)."""
    x_scale = jnp.maximum(jnp.abs(x).max().astype(jnp.float32), 1e-12) / schemes.FP8_MAX
    x8 = (x.astype(jnp.float32) / x_scale).astype(jnp.float8_e4m3fn)
    out = jnp.dot(x8, values, preferred_element_type=jnp.float32)
    return (out * (scales * x_scale)[None, :]).astype(x.dtype)


def bench_matmul(setup: Setup, copy_bw: float, kernel_rows: tuple[str, ...] = ("w8a16", "w4a16")):
    for (k, n), m in itertools.product(setup.shapes, setup.ms):
        x = jax.random.normal(jax.random.key(99), (m, k), jnp.float32).astype(jnp.bfloat16)
        rows = {}
        for name, (fn, make, nbytes) in impls(k, n, setup, kernel_rows).items():
            weights = weight_copies(make, nbytes, setup)
            seconds = chained_seconds(fn, x, weights, setup)
            rows[name] = dict(section="matmul", impl=name, m=m, k=k, n=n, us=seconds * 1e6, weight_bytes=nbytes,
                              frac_copy_bw=nbytes / seconds / copy_bw, copies=len(weights))
            del weights
        base = rows["bf16_dot"]["us"]
        for row in rows.values():
            row["speedup_vs_bf16"] = base / row["us"]
        yield list(rows.values())


def sweep_configs(scheme: str, k: int, n: int) -> list[qm.MatmulConfig]:
    group = schemes.group_size(k) if scheme == "int4" else None
    configs = []
    for block_n, splits, block_k, planes in itertools.product(
            (32, 64, 128), (1, 2, 4, 8), (128, 256) if scheme == "int8" else (128,),
            (None,) if scheme == "int8" else (False, True)):
        config = qm.MatmulConfig(16, block_n, block_k, splits, num_warps=4, num_stages=4, x_planes=planes)
        try:
            qm.check_config(k, n, scheme, group, config)
        except ValueError:
            continue
        configs.append(config)
    return configs


def sweep(setup: Setup, copy_bw: float, m: int = 16):
    """Launch configs of both kernels at a decode-sized M (1..16 rows all run in one 16-row block); the down
    projection (14336 x 4096, the shape with the fewest output tiles) first. One row per config."""
    for (k, n), scheme in itertools.product(setup.shapes[::-1], ("int8", "int4")):
        _, make, nbytes = impls(k, n, setup)[f"w{scheme[3:]}a16_pallas"]
        weights = weight_copies(make, nbytes, setup)
        x = jax.random.normal(jax.random.key(98), (m, k), jnp.float32).astype(jnp.bfloat16)
        for config in sweep_configs(scheme, k, n)[: (2 if setup.interpret else None)]:
            fn = lambda x, v, s, config=config: qm.quant_matmul(x, v, s, scheme=scheme, out_dtype=x.dtype,  # noqa
                                                                 interpret=setup.interpret, config=config)
            seconds = chained_seconds(fn, x, weights, setup)
            yield [dict(section="sweep", impl=f"w{scheme[3:]}a16", m=m, k=k, n=n, us=seconds * 1e6,
                        frac_copy_bw=nbytes / seconds / copy_bw, config=dataclasses.asdict(config))]


def bench_e2e(args, schemes_to_run, copy_bw: float):
    """Batch-1 decode tokens/s of a random Llama-3-8B-shaped model per scheme; the floor is one read of every
    weight byte at the measured copy bandwidth."""
    from jaxserve.config import EngineConfig, ModelConfig, RopeConfig
    from jaxserve.engine.engine import LLMEngine
    from jaxserve.models.llama import random_model
    from jaxserve.sampling_params import SamplingParams
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                      rope=RopeConfig(theta=500000.0))
    if args.smoke:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=32, dtype="float32")
    total = args.input_len + args.output_len
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=args.input_len, max_model_len=total,
                          decode_buckets=(1,), prefill_token_buckets=(args.input_len,), prefill_seq_buckets=(1,),
                          context_buckets=(total,), kv_cache_memory=2**28, compilation_cache_dir="",
                          xla_optimization_level=0 if args.smoke else None)
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, args.input_len).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for name in schemes_to_run:
        weights, _, kv = name.partition("+kv-")
        model = random_model(dataclasses.replace(cfg, quantization=None if weights == "bf16" else weights), dtype)
        started = time.perf_counter()
        engine = LLMEngine(model, config.replace(kv_cache_dtype=kv or "auto"), show_progress=False)
        compile_s = time.perf_counter() - started
        for tag in ("warm", "run"):
            engine.add_request(tag, prompt, params)
            engine.run_until_done()
        steps = list(engine.core.stats.steps)[-args.output_len:]
        gaps = [(b.done_at - a.done_at) / b.burst for a, b in zip(steps, steps[1:])  # a burst: b.burst steps
                if a.shape.kind == "decode" and b.shape.kind == "decode"]
        step = statistics.median(gaps)
        floor = engine.core.weight_bytes / copy_bw
        yield [dict(section="e2e", scheme=name, batch=1, decode_tok_s=1 / step, decode_step_ms=step * 1e3,
                    weight_floor_ms=floor * 1e3, step_vs_floor=step / floor, weight_mb=engine.core.weight_bytes / 2**20,
                    compile_s=compile_s, matmul=engine.core.kernels.matmul_name,
                    attention=engine.core.kernels.attention_name)]
        del engine, model


def record(results: dict, batches, out: str | None) -> None:
    for rows in batches:
        results.setdefault("rows", []).extend(rows)
        for row in rows:
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if out:
            Path(out).write_text(json.dumps(results, indent=2) + "\n")


def summarize(results: dict) -> list[str]:
    rows = results.get("rows", [])
    lines = [f"device: {results['device']}, copy bandwidth {results['copy_bandwidth_GBps']:.0f} GB/s"]
    matmul = [r for r in rows if r["section"] == "matmul"]
    if matmul:
        lines += ["", "| M | K x N | bf16 dot us | W8A16 us (x) | W4A16 us (x) | W8A16 % copy bw | W8 XLA us |",
                  "|---|---|---|---|---|---|---|"]
    variants = []
    for (m, k, n), group in itertools.groupby(matmul, key=lambda r: (r["m"], r["k"], r["n"])):
        by = {r["impl"]: r for r in group}
        variants += [r for name, r in by.items() if name not in MAIN_IMPLS]
        if "w8a16_pallas" not in by or "w4a16_pallas" not in by:
            continue
        w8, w4 = by["w8a16_pallas"], by["w4a16_pallas"]
        lines.append(f"| {m} | {k}x{n} | {by['bf16_dot']['us']:.1f} | {w8['us']:.1f} ({w8['speedup_vs_bf16']:.2f}x) "
                     f"| {w4['us']:.1f} ({w4['speedup_vs_bf16']:.2f}x) | {100 * w8['frac_copy_bw']:.0f}% "
                     f"| {by['w8a16_xla']['us']:.1f} |")
    if variants:
        lines += ["", "imported formats (jaxserve.convert.quantized):", "",
                  "| M | K x N | kernel | scheme | us | vs bf16 dot | % copy bw |", "|---|---|---|---|---|---|---|"]
        for r in variants:
            row = r["impl"].rsplit("_", 1)[0].removesuffix("_xla")
            lines.append(f"| {r['m']} | {r['k']}x{r['n']} | {r['impl']} | {KERNEL_ROWS.get(row, 'fp8 (W8A8)')} | "
                         f"{r['us']:.1f} | {r['speedup_vs_bf16']:.2f}x | {100 * r['frac_copy_bw']:.0f}% |")
    small = [r["speedup_vs_bf16"] for r in matmul if r["impl"] == "w8a16_pallas" and r["m"] <= 16]
    if small:
        ok = min(small) >= TARGETS["w8a16_speedup_m16"]
        lines.append(f"\nW8A16 at M <= 16: {min(small):.2f}x .. {max(small):.2f}x the bf16 dot "
                     f"({'PASS' if ok else 'FAIL'} >= {TARGETS['w8a16_speedup_m16']}x)")
    e2e = {r["scheme"]: r for r in rows if r["section"] == "e2e"}
    if e2e:
        lines += ["", "| scheme | batch-1 decode tok/s | step ms | weight-read floor ms | weights MiB | vs bf16 |",
                  "|---|---|---|---|---|---|"]
        base = e2e.get("bf16", {}).get("decode_tok_s")
        for name, r in e2e.items():
            ratio = f"{r['decode_tok_s'] / base:.2f}x" if base else ""
            lines.append(f"| {name} | {r['decode_tok_s']:.1f} | {r['decode_step_ms']:.2f} | "
                         f"{r['weight_floor_ms']:.2f} | {r['weight_mb']:.0f} | {ratio} |")
        if base and "int8" in e2e:
            ratio = e2e["int8"]["decode_tok_s"] / base
            ok = ratio >= TARGETS["e2e_int8_speedup_batch1"]
            lines.append(f"\nint8 batch-1 decode: {ratio:.2f}x bf16 ({'PASS' if ok else 'FAIL'} >= "
                         f"{TARGETS['e2e_int8_speedup_batch1']}x)")
    best = _best_sweep(rows)
    if best:
        lines += ["", "best launch configs at M = 16 (sweep):"] + best
    return lines


def _best_sweep(rows) -> list[str]:
    sweep_rows = [r for r in rows if r["section"] == "sweep"]
    out = []
    for key, group in itertools.groupby(sweep_rows, key=lambda r: (r["impl"], r["k"], r["n"])):
        best = min(group, key=lambda r: r["us"])
        out.append(f"  {key[0]} {key[1]}x{key[2]}: {best['us']:.1f} us, {100 * best['frac_copy_bw']:.0f}% copy bw, "
                   f"{best['config']}")
    return out


def summarize_files(paths: list[str], markdown: str | None) -> dict:
    """One summary over several saved runs (missing files are skipped: a phase may have hit its time cap)."""
    runs = [json.loads(Path(p).read_text()) for p in paths if Path(p).exists()]
    if not runs:
        print(f"no results in {paths}")
        return {}
    merged = dict(runs[0], rows=[row for run in runs for row in run.get("rows", [])])
    lines = summarize(merged)
    print("\n".join(lines))
    if markdown:
        Path(markdown).write_text("\n".join(lines) + "\n")
    return merged


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (any machine)")
    ap.add_argument("--only", choices=("matmul", "e2e", "sweep"), help="run one section")
    ap.add_argument("--sweep", action="store_true", help="also sweep launch configs at M = 16")
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="print the tables of saved runs and exit")
    ap.add_argument("--e2e-schemes", nargs="+", default=["bf16", "int8", "int4", "int8+kv-int8"])
    ap.add_argument("--rows", nargs="+", choices=tuple(KERNEL_ROWS), default=["w8a16", "w4a16"],
                    help="kernel rows of the matmul section (default: the formats --quantize writes)")
    ap.add_argument("--ms", nargs="+", type=int, help="token counts M of the matmul section (default 1 16 64 256)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", help="write results (JSON) after every section")
    ap.add_argument("--markdown", help="write the summary table as Markdown")
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize_files(args.summarize, args.markdown)
    setup = SMOKE if args.smoke else GPU
    if args.ms:
        setup = dataclasses.replace(setup, ms=tuple(args.ms))
    copy_bw = copy_bandwidth(setup)
    device = jax.devices()[0]
    results = dict(device=device.device_kind, copy_bandwidth_GBps=copy_bw / 1e9, setup=dataclasses.asdict(setup))
    print(f"device: {device.device_kind}; copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    if args.only in (None, "matmul"):
        record(results, bench_matmul(setup, copy_bw, tuple(args.rows)), args.out)
    if args.only in (None, "e2e"):
        record(results, bench_e2e(args, args.e2e_schemes, copy_bw), args.out)
    if args.sweep or args.only == "sweep":
        record(results, sweep(setup, copy_bw), args.out)
    lines = summarize(results)
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
