"""Attention kernels against their references, the XLA path and JAX's shipped Pallas paged-attention example.

    python bench/kernels.py [--out results.json] [--sweep]      on a GPU
    python bench/kernels.py --smoke [--out results.json]         tiny shapes, interpret mode, any machine
    python bench/kernels.py --summarize results.json [--e2e e2e.json] [--markdown RESULTS.md]

Decode shapes: batch 1/16/64/256 x context 512/2048/8192, 8 KV heads, 32 query heads, head_dim 128, bf16, every
sequence at full context. Achieved bandwidth counts the K and V bytes a decode step must read and is reported
as a fraction of the device's measured copy bandwidth (a large on-device elementwise pass, read + write).
Each timing runs N calls chained inside one jit (call i's output is call i+1's query), so Python dispatch is
amortised and nothing can be hoisted; rows whose K/V fit in L2 are marked, as they can beat the HBM ceiling.
--sweep also times decode launch configs and page sizes at batch 64 x context 2048 (the issue's target shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout

from jaxserve.kv.cache import AttentionMetadata  # noqa: E402
from jaxserve.models import attention as xla_attention  # noqa: E402
from jaxserve.observability.ceilings import ProbeSize, measure_copy_bandwidth  # noqa: E402
from pallas_kernels import paged_attention as pa  # noqa: E402
from pallas_kernels import ragged_paged_attention as rpa  # noqa: E402

TARGET = dict(batch=64, context=2048, frac_copy_bw=0.75)  # issue 5: decode vs copy bandwidth, and >= JAX's example
L2_BYTES = 50 * 2**20  # H100/H200 L2: a working set below ~this can stay on chip between chained calls


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one run measures: problem sizes, how long to time, and whether kernels are interpreted."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    kv_heads: int
    heads: int
    head_dim: int
    page_size: int
    dtype: str
    chain: int  # calls per timed jit
    reps: int  # timed repetitions (median taken)
    interpret: bool
    copy_bytes: int
    max_reference_bytes: int  # skip the float32 reference beyond this gathered size
    compiler_options: dict | None = None


GPU = Setup((1, 16, 64, 256), (512, 2048, 8192), 8, 32, 128, 16, "bfloat16", 10, 5, False, 2**31, 2**33)
# Interpret mode is compile-bound: one shape per kernel, LLVM optimisation off.
SMOKE = Setup((3,), (40,), 2, 8, 64, 16, "float32", 1, 1, True, 2**22, 2**30,
              {"xla_backend_optimization_level": 0})


# ---------------------------------------------------------------------------------------------- timing


def chained(fn, n: int, setup: Setup):
    """jit of n dependent calls: fn(q, *rest) -> array shaped like q, fed back as the next q.

    A fori_loop with a static trip count: one kernel instance to compile, and XLA runs a known-trip-count loop
    without reading a predicate back to the host each iteration.
    """
    def run(q, *rest):
        return jax.lax.fori_loop(0, n, lambda _, q: fn(q, *rest).astype(q.dtype), q)
    return jax.jit(run, compiler_options=setup.compiler_options)


def seconds_per_call(fn, args, setup: Setup, run=None) -> float:
    """Median wall time of `setup.chain` chained calls, per call. `run`: an already compiled chain to reuse."""
    run = run or chained(fn, setup.chain, setup)
    jax.block_until_ready(run(*args))  # compile (or, the first time in a process, retrace) and warm up
    times = []
    for _ in range(setup.reps):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / setup.chain


def copy_bandwidth(setup: Setup) -> float:
    """Bytes per second of an in-place elementwise pass: the probe the engine's metrics use for its ceiling."""
    size = ProbeSize(setup.copy_bytes, copy_passes=8 if jax.default_backend() == "gpu" else 1, matmul_n=0,
                     repeats=max(3, setup.reps))
    return measure_copy_bandwidth(jax.devices()[0], size)


# ---------------------------------------------------------------------------------------------- problems


def paged_pool(key, num_pages: int, setup: Setup):
    """One layer's K and V pools, [1, kv_heads, pages, page_size, head_dim], random on device."""
    shape = (1, setup.kv_heads, num_pages, setup.page_size, setup.head_dim)
    kk, kv = jax.random.split(key)
    return (jax.random.normal(kk, shape, jnp.float32).astype(setup.dtype),
            jax.random.normal(kv, shape, jnp.float32).astype(setup.dtype))


def shuffled_tables(key, context_lens, setup: Setup):
    """[N, P] page ids: a random permutation of pages 1.. spread over the sequences; pool size."""
    pages_per_seq = -(-max(context_lens) // setup.page_size)
    num_pages = len(context_lens) * pages_per_seq + 1
    ids = jax.random.permutation(key, jnp.arange(1, num_pages, dtype=jnp.int32))
    return ids.reshape(len(context_lens), pages_per_seq), num_pages


def decode_problem(batch: int, context: int, setup: Setup, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    tables, num_pages = shuffled_tables(keys[0], [context] * batch, setup)
    ck, cv = paged_pool(keys[1], num_pages, setup)
    q = jax.random.normal(keys[2], (batch, setup.heads, setup.head_dim), jnp.float32).astype(setup.dtype)
    return q, ck, cv, tables, jnp.full((batch,), context, jnp.int32)


def kv_bytes(context_lens, setup: Setup) -> int:
    return int(sum(context_lens)) * setup.kv_heads * setup.head_dim * 2 * jnp.dtype(setup.dtype).itemsize


# ---------------------------------------------------------------------------------------------- decode


def decode_impls(setup: Setup, config: pa.DecodeConfig | None = None) -> dict:
    """name -> fn(q, ck, cv, tables, lens) for every decode implementation under comparison."""
    scale = setup.head_dim ** -0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_example
    return {
        "pallas": lambda q, ck, cv, bt, n: pa.paged_attention(q, ck, cv, 0, bt, n, scale=scale,
                                                              interpret=setup.interpret, config=config),
        "jax_example": lambda q, ck, cv, bt, n: jax_example.paged_attention(
            q * scale, ck[0], cv[0], bt, n, interpret=setup.interpret, **example_blocks(bt.shape[1])),
        "xla": lambda q, ck, cv, bt, n: xla_attention.decode_attention_xla(q, ck, cv, 0, bt, n, scale=scale,
                                                                           sliding_window=None),
        "reference": lambda q, ck, cv, bt, n: pa.paged_attention_reference(q, ck, cv, 0, bt, n, scale=scale),
    }


def example_blocks(pages_per_seq: int) -> dict:
    """The JAX example's defaults (k_splits 16, 8 pages per block), shrunk where its divisibility rules need."""
    k_splits = 16
    while pages_per_seq % k_splits:
        k_splits //= 2
    return dict(k_splits=k_splits, pages_per_compute_block=min(8, pages_per_seq // k_splits))


def decode_shapes(setup: Setup) -> list[tuple[int, int]]:
    """(batch, context) pairs, the issue's target shape first so a time cap cannot cost its numbers."""
    shapes = [(batch, context) for batch in setup.batches for context in setup.contexts]
    return sorted(shapes, key=lambda shape: shape != (TARGET["batch"], TARGET["context"]))


def bench_decode(setup: Setup, copy_bw: float):
    """Yields the rows of one (batch, context) shape at a time."""
    impls = decode_impls(setup)
    for batch, context in decode_shapes(setup):
        args = decode_problem(batch, context, setup)
        yield measure_all(impls, args, kv_bytes([context] * batch, setup), setup, copy_bw,
                          dict(kernel="decode", batch=batch, context=context))
        del args


def measure_all(impls: dict, args, nbytes: int, setup: Setup, copy_bw: float, labels: dict,
                flops: float | None = None) -> list[dict]:
    """Times every impl on the same inputs; errors are against the XLA path's output."""
    once = {name: chained(fn, 1, setup) for name, fn in impls.items()}
    expected = once["xla"](*args).astype(jnp.float32)
    rows = []
    for name, fn in impls.items():
        row = dict(labels, impl=name, kv_bytes=nbytes, l2_resident=nbytes < L2_BYTES)
        if name == "reference" and reference_bytes(args, labels) > setup.max_reference_bytes:
            rows.append(dict(row, skipped="float32 reference too large for this shape"))
            continue
        try:
            err = float(jnp.abs(once[name](*args).astype(jnp.float32) - expected).max())
            seconds = seconds_per_call(fn, args, setup, once[name] if setup.chain == 1 else None)
        except Exception as e:  # one failing impl must not hide the others' numbers
            rows.append(dict(row, skipped=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
            continue
        row.update(ms=seconds * 1e3, GBps=nbytes / seconds / 1e9, frac_copy_bw=nbytes / seconds / copy_bw,
                   max_abs_err_vs_xla=err)
        if flops is not None:
            row["TFLOPs"] = flops / seconds / 1e12
        rows.append(row)
    return rows


def reference_bytes(args, labels: dict) -> int:
    """Bytes the float32 reference materialises: every query's gathered K and V."""
    q, ck, _, tables = args[:4]
    rows = q.shape[0] if labels["kernel"] == "ragged" else tables.shape[0]
    return 2 * 4 * rows * tables.shape[1] * ck.shape[1] * ck.shape[3] * ck.shape[4]


# ---------------------------------------------------------------------------------------------- ragged


def ragged_mixes(setup: Setup) -> dict:
    """name -> (query_lens, context_lens, num_tokens): prefill, chunked prefill, mixed and decode-like steps."""
    c = max(setup.contexts)
    if setup.interpret:
        return {"mixed": ([20, 1, 9], [20, c, 30], 32)}
    return {
        "prefill 1x2048": ([2048], [2048], 2048),
        "chunks 4x512 (1536 cached)": ([512] * 4, [2048] * 4, 2048),
        "mixed 4x256 + 60 decode": ([256] * 4 + [1] * 60, [1024] * 4 + [2048] * 60, 1152),
        "decode-like 256x1": ([1] * 256, [2048] * 256, 256),
        "verify 8x(3+1)": ([4] * 8, [2048] * 8, 32),  # speculative decoding: K = 3 proposals + the last token
        "verify 64x(3+1)": ([4] * 64, [2048] * 64, 256),
    }


def ragged_problem(query_lens, context_lens, num_tokens: int, setup: Setup, seed: int = 1):
    keys = jax.random.split(jax.random.key(seed), 3)
    tables, num_pages = shuffled_tables(keys[0], context_lens, setup)
    ck, cv = paged_pool(keys[1], num_pages, setup)
    q = jax.random.normal(keys[2], (num_tokens, setup.heads, setup.head_dim), jnp.float32).astype(setup.dtype)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]), jnp.int32)
    return q, ck, cv, tables, jnp.asarray(context_lens, jnp.int32), query_start


def ragged_flops(query_lens, context_lens, setup: Setup) -> float:
    """2 matmuls x 2 FLOPs x head_dim x heads per (query, visible key) pair."""
    pairs = sum(sum(ctx - q + 1 + i for i in range(q)) for q, ctx in zip(query_lens, context_lens))
    return 4.0 * setup.head_dim * setup.heads * pairs


def ragged_impls(setup: Setup, page_size: int) -> dict:
    scale = setup.head_dim ** -0.5

    def xla(q, ck, cv, bt, n, qs):
        meta = AttentionMetadata.build(bt, n, qs, q.shape[0], page_size)
        return xla_attention.ragged_attention_xla(q, ck, cv, 0, meta, scale=scale, sliding_window=None)

    return {
        "pallas": lambda q, ck, cv, bt, n, qs: rpa.ragged_paged_attention(q, ck, cv, 0, bt, n, qs, scale=scale,
                                                                          interpret=setup.interpret),
        "xla": xla,
        "reference": lambda q, ck, cv, bt, n, qs: rpa.ragged_paged_attention_reference(q, ck, cv, 0, bt, n, qs,
                                                                                       scale=scale),
    }


def bench_ragged(setup: Setup, copy_bw: float):
    """Yields the rows of one token mix at a time."""
    impls = ragged_impls(setup, setup.page_size)
    for name, (query_lens, context_lens, num_tokens) in ragged_mixes(setup).items():
        args = ragged_problem(query_lens, context_lens, num_tokens, setup)
        yield measure_all(impls, args, kv_bytes(context_lens, setup), setup, copy_bw,
                          dict(kernel="ragged", mix=name, tokens=num_tokens),
                          flops=ragged_flops(query_lens, context_lens, setup))


# ---------------------------------------------------------------------------------------------- sweep


def sweep_decode(setup: Setup, copy_bw: float, batch: int = 64, context: int = 2048):
    """Launch configs and page sizes of the decode kernel at the target shape (one config with --smoke)."""
    base = pa.choose_decode_config(batch, setup.kv_heads, setup.head_dim, jnp.dtype(setup.dtype).itemsize,
                                   context)
    configs = [dataclasses.replace(base, block_k=bk, num_warps=w, num_stages=s)
               for bk in (32, 64, 128) for w, s in ((4, 2), (4, 3), (4, 4), (8, 3))]
    configs += [dataclasses.replace(base, num_splits=n) for n in (2, 4)]
    page_sizes = (16, 32, 64)
    if setup.interpret:
        configs, page_sizes = configs[:1], ()
    args = decode_problem(batch, context, setup)
    for config in configs:
        yield [sweep_row(setup, config, args, batch, context, copy_bw)]
    del args
    for page_size in page_sizes:
        paged = dataclasses.replace(setup, page_size=page_size)
        yield [sweep_row(paged, None, decode_problem(batch, context, paged), batch, context, copy_bw)]


def sweep_row(setup, config, args, batch, context, copy_bw) -> dict:
    fn = decode_impls(setup, config)["pallas"]
    row = dict(kernel="decode", batch=batch, context=context, page_size=setup.page_size,
               config=dataclasses.asdict(config) if config else "auto")
    try:
        seconds = seconds_per_call(fn, args, setup)
    except Exception as e:
        return dict(row, skipped=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    nbytes = kv_bytes([context] * batch, setup)
    return dict(row, ms=seconds * 1e3, frac_copy_bw=nbytes / seconds / copy_bw)


# ---------------------------------------------------------------------------------------------- report


def print_table(title: str, rows: list[dict], keys: tuple[str, ...]) -> None:
    print(f"\n{title}")
    groups: dict[tuple, dict] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), {})[row["impl"]] = row
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    print("  ".join(f"{k:>24}" if k == "mix" else f"{k:>7}" for k in keys) + "".join(f"{i:>22}" for i in impls))
    for key, by_impl in groups.items():
        cells = [f"{v:>24}" if k == "mix" else f"{v:>7}" for k, v in zip(keys, key)]
        print("  ".join(cells) + "".join(f"{cell(by_impl.get(i)):>22}" for i in impls))


def cell(row: dict | None) -> str:
    if row is None or "ms" not in row:
        return "skipped"
    mark = "*" if row["l2_resident"] else ""
    return f"{row['ms']:.3f}ms {100 * row['frac_copy_bw']:.0f}%{mark}"


def summarize(results: dict, e2e: dict | None) -> list[str]:
    """Markdown lines: the decode table, the target check, ragged throughput, the best sweep entry, e2e."""
    lines = [f"device: {results['device']}, copy bandwidth {results['copy_bandwidth_GBps']:.0f} GB/s", "",
             "| batch | context | pallas | jax example | xla | pallas vs example |", "|---|---|---|---|---|---|"]
    by_shape: dict[tuple, dict] = {}
    for row in results["decode"]:
        by_shape.setdefault((row["batch"], row["context"]), {})[row["impl"]] = row
    for (batch, context), rows in by_shape.items():
        ratio = speedup(rows.get("jax_example"), rows.get("pallas"))
        lines.append(f"| {batch} | {context} | {cell(rows.get('pallas'))} | {cell(rows.get('jax_example'))} | "
                     f"{cell(rows.get('xla'))} | {ratio} |")
    lines += ["", target_check(by_shape.get((TARGET["batch"], TARGET["context"]), {})), ""]
    for row in results["ragged"]:
        if row["impl"] == "pallas" and "ms" in row:
            lines.append(f"ragged {row['mix']}: {row['ms']:.3f} ms, {row['TFLOPs']:.1f} TFLOP/s, "
                         f"{100 * row['frac_copy_bw']:.0f}% of copy bandwidth")
    timed = [r for r in results.get("sweep", []) if "ms" in r]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        lines.append(f"best decode sweep entry: page {best['page_size']}, {best['config']}: {best['ms']:.3f} ms "
                     f"({100 * best['frac_copy_bw']:.0f}%)")
    lines.append(f"e2e: {json.dumps(e2e)[:1500]}" if e2e is not None else "e2e: no result (see e2e.log)")
    return lines


def speedup(baseline: dict | None, ours: dict | None) -> str:
    if not baseline or not ours or "ms" not in baseline or "ms" not in ours:
        return "n/a"
    return f"{baseline['ms'] / ours['ms']:.2f}x"


def target_check(rows: dict) -> str:
    ours, example = rows.get("pallas"), rows.get("jax_example")
    if not ours or "ms" not in ours:
        return "target shape: pallas decode did not run"
    bandwidth_ok = ours["frac_copy_bw"] >= TARGET["frac_copy_bw"]
    faster = example is not None and "ms" in example and ours["ms"] <= example["ms"]
    return (f"target B={TARGET['batch']} ctx={TARGET['context']}: {100 * ours['frac_copy_bw']:.0f}% of copy "
            f"bandwidth ({'PASS' if bandwidth_ok else 'FAIL'} >= {100 * TARGET['frac_copy_bw']:.0f}%), "
            f"{speedup(example, ours)} vs JAX example ({'PASS' if faster else 'FAIL'} >= 1x)")


def summary_main(args) -> list[str]:
    results = json.loads(args.summarize.read_text())
    e2e = json.loads(args.e2e.read_text()) if args.e2e and args.e2e.exists() else None
    lines = summarize(results, e2e)
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("# Kernel and end-to-end results\n\n" + "\n".join(lines) + "\n")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU is fine)")
    parser.add_argument("--sweep", action="store_true", help="also sweep decode launch configs and page sizes")
    parser.add_argument("--out", type=Path, help="write all rows as JSON here")
    parser.add_argument("--summarize", type=Path, help="print the short table of an earlier --out JSON and stop")
    parser.add_argument("--e2e", type=Path, help="with --summarize: bench/offline_throughput.py's JSON")
    parser.add_argument("--markdown", type=Path, help="with --summarize: also write the table here")
    args = parser.parse_args(argv)
    if args.summarize:
        return dict(summary=summary_main(args))
    if not args.smoke and jax.default_backend() != "gpu":
        parser.error("no GPU attached: run with --smoke for the interpret-mode check")
    setup = SMOKE if args.smoke else GPU
    copy_bw = copy_bandwidth(setup)
    device = jax.devices()[0]
    print(f"device: {device.device_kind}; copy bandwidth {copy_bw / 1e9:.0f} GB/s; "
          f"{'interpret mode' if setup.interpret else 'compiled'}; * = K/V fit in L2")
    results = dict(device=device.device_kind, copy_bandwidth_GBps=copy_bw / 1e9, setup=dataclasses.asdict(setup))
    record(results, "decode", bench_decode(setup, copy_bw), args.out)
    print_table("decode (ms per call, % of copy bandwidth)", results["decode"], ("batch", "context"))
    record(results, "ragged", bench_ragged(setup, copy_bw), args.out)
    print_table("ragged (ms per call, % of copy bandwidth)", results["ragged"], ("mix", "tokens"))
    if args.sweep:
        shape = (setup.batches[0], setup.contexts[0]) if args.smoke else ()
        record(results, "sweep", sweep_decode(setup, copy_bw, *shape), args.out)
    return results


def record(results: dict, section: str, batches, out: Path | None) -> None:
    """Collects rows batch by batch, logging each and rewriting `out`, so a run cut short keeps what it measured."""
    results[section] = []
    for rows in batches:
        results[section] += rows
        for row in rows:
            print(f"  {section}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in row.items() if k not in ("kernel", "l2_resident")))
        if out:
            out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
