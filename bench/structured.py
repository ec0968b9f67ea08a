#!/usr/bin/env python3
"""Structured output on this machine: the grammar engines compared, then the cost in the engine.

    engines     llguidance vs outlines-core on this project's tokenizers (the demo model's and the test fixtures'):
                compile time per schema (cold) and mask time per token (µs, p50/p99) over random walks through
                each grammar. xgrammar is listed but not measured when it cannot be imported (it needs torch).
    throughput  the demo model, batch 1 and 16: output tok/s of unconstrained vs JSON-schema-constrained requests,
                interleaved A/B in one process (repeats), plus the engine's own mask + matcher-advance time per
                constrained token (µs, p50/p99) and grammar compile time.

    python bench/structured.py                      # both parts, demo model, batch 1 and 16
    python bench/structured.py --part engines
    python bench/structured.py --part throughput --batch-sizes 1 16 --repeats 3 --out structured.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.structured import StructuredOutputsParams  # noqa: E402
from jaxserve.structured.grammar import GrammarCompiler  # noqa: E402

TOKENIZERS = {"demo (spm, 4096)": ROOT / "checkpoints" / "demo",
              "llama3_bbpe fixture": ROOT / "tests" / "fixtures" / "tokenizers" / "llama3_bbpe",
              "qwen2_bbpe fixture": ROOT / "tests" / "fixtures" / "tokenizers" / "qwen2_bbpe",
              "llama2_spm fixture": ROOT / "tests" / "fixtures" / "tokenizers" / "llama2_spm"}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "score": {"type": "number"}, "role": {"enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "integer"}}, "required": ["city", "zip"]},
    "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
    "nickname": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
    "required": ["name", "age", "score", "role", "address", "tags"], "additionalProperties": False}
RECORDS = {"type": "array", "minItems": 64, "items": {  # never complete within 128 tokens: every token is masked
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 8}},
    "required": ["id", "name"], "additionalProperties": False}}
SCHEMAS = {"person": PERSON, "records": RECORDS}


def percentiles(values: list[float]) -> dict:
    values = sorted(values)
    return {"p50": values[len(values) // 2], "p99": values[min(len(values) - 1, int(len(values) * 0.99))],
            "n": len(values)}


# ---- part 1: the engines ---------------------------------------------------------------------------------------
def bench_llguidance(compiler: GrammarCompiler, schema: dict, walks: int, length: int, seed: int) -> dict:
    import llguidance
    import llguidance.numpy as llnp
    compiler.ll_tokenizer  # built once per tokenizer, not per schema
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    template = llguidance.LLMatcher(compiler.ll_tokenizer, grammar, log_level=0)
    compile_s = time.perf_counter() - started
    rng = random.Random(seed)
    mask = np.zeros((1, compiler.mask_words), np.int32)
    times = []
    for _ in range(walks):
        matcher = template.deep_copy()
        for _ in range(length):
            t0 = time.perf_counter()
            llnp.fill_next_token_bitmask(matcher, mask, 0)
            times.append((time.perf_counter() - t0) * 1e6)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
            allowed = [int(t) for t in allowed if t not in compiler.eos_token_ids]
            if not allowed:
                break
            matcher.consume_token(rng.choice(allowed))
    return {"compile_ms": compile_s * 1e3, "mask_us": percentiles(times)}


def bench_outlines(compiler: GrammarCompiler, schema: dict, walks: int, length: int, seed: int) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    tokenizer = compiler.ll_tokenizer
    eos = compiler.eos_token_ids[0]
    vocabulary: dict[bytes, list[int]] = {}
    for token in range(tokenizer.vocab_size):
        if token in compiler.eos_token_ids or tokenizer.is_special_token(token):
            continue
        text = tokenizer.decode_bytes([token])
        if text:
            vocabulary.setdefault(text, []).append(token)
    vocab = outlines_core.Vocabulary(eos, vocabulary)
    started = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(schema)), vocab)
    compile_s = time.perf_counter() - started
    rng = random.Random(seed)
    times = []
    mask = np.zeros(compiler.mask_words, np.int32)
    for _ in range(walks):
        guide = outlines_core.Guide(index)
        for _ in range(length):
            t0 = time.perf_counter()  # the same product as llguidance's: a packed bitmask in a host buffer
            guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            times.append((time.perf_counter() - t0) * 1e6)
            allowed = [t for t in guide.get_tokens() if t != eos]
            if not allowed or guide.is_finished():
                break
            guide.advance(rng.choice(allowed))
    return {"compile_ms": compile_s * 1e3, "mask_us": percentiles(times)}


def part_engines(args) -> list[dict]:
    from jaxserve.tokenizer import load_tokenizer
    rows = []
    try:
        import xgrammar  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - report why it was not measured
        rows.append({"engine": "xgrammar", "skipped": f"{type(exc).__name__}: {exc}"})
        print(f"xgrammar: not measured ({type(exc).__name__}: {exc})")
    for name, path in TOKENIZERS.items():
        tokenizer = load_tokenizer(path)
        compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
        for schema_name, schema in SCHEMAS.items():
            for engine, fn in (("llguidance", bench_llguidance), ("outlines-core", bench_outlines)):
                result = fn(compiler, schema, args.walks, args.walk_length, seed=0)
                row = {"engine": engine, "tokenizer": name, "schema": schema_name, **result}
                rows.append(row)
                m = result["mask_us"]
                print(f"{engine:14s} {name:22s} {schema_name:8s} compile {result['compile_ms']:9.1f} ms   "
                      f"mask/token p50 {m['p50']:8.1f} µs  p99 {m['p99']:8.1f} µs  ({m['n']} tokens)")
    return rows


# ---- part 2: in the engine -------------------------------------------------------------------------------------
def build_engine(args, max_seqs: int):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import LLMEngine
    buckets = tuple(sorted(set(args.batch_sizes)))
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(256, args.input_len * max_seqs // 2),
                          max_model_len=args.input_len + args.output_len, decode_buckets=buckets,
                          compilation_cache_dir="")
    return LLMEngine.from_model_dir(args.model, config, show_progress=False)


class MaskTimer:
    """Wraps the engine's StructuredOutputs: time spent producing masks and advancing matchers, per token."""

    def __init__(self, structured):
        self.structured = structured
        self.per_token_us: list[float] = []
        self._disallowed, self._accept = structured.disallowed, structured.accept
        structured.disallowed, structured.accept = self.disallowed, self.accept

    def disallowed(self, rows, vocab_size):
        t0 = time.perf_counter()
        out = self._disallowed(rows, vocab_size)
        if out is not None:
            constrained = sum(1 for rid, i, samples in rows if samples and self.structured.is_constrained(rid, i))
            self.per_token_us.extend([(time.perf_counter() - t0) * 1e6 / constrained] * constrained)
        return out

    def accept(self, request_id, index, token_id):
        t0 = time.perf_counter()
        self._accept(request_id, index, token_id)
        if self.per_token_us:
            self.per_token_us[-1] += (time.perf_counter() - t0) * 1e6


def timed_run(engine, prompts, params) -> tuple[int, float]:
    from jaxserve.outputs import OutputKind
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", prompt, params, kind=OutputKind.FINAL_ONLY)
    started = time.perf_counter()
    finals = []
    while engine.has_unfinished_requests():
        finals.extend(o for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - started
    return sum(len(s.token_ids) for o in finals for s in o.outputs), elapsed


def part_throughput(args) -> list[dict]:
    from jaxserve.sampling_params import SamplingParams
    engine = build_engine(args, max(args.batch_sizes))
    started = time.perf_counter()
    late = engine.core.prepare_late_masks(wait=True)  # steady state: what the first constrained request starts
    print(f"split decode executables (late masks): {'ready' if late else 'not available'} after "
          f"{time.perf_counter() - started:.1f} s")
    timer = MaskTimer(engine.core.structured)
    constraint = StructuredOutputsParams(json=RECORDS, disable_any_whitespace=True)
    started = time.perf_counter()
    compiled = engine.core.structured.compiler.compile(constraint)
    print(f"grammar compile (records schema, demo tokenizer): {(time.perf_counter() - started) * 1e3:.1f} ms")
    rng = np.random.default_rng(0)
    vocab = engine.tokenizer.vocab_size
    rows = []
    for batch in args.batch_sizes:
        prompts = [rng.integers(3, vocab, args.input_len).tolist() for _ in range(batch)]
        plain = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=1)
        guided = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=1,
                                structured_outputs=constraint)
        timed_run(engine, prompts, plain), timed_run(engine, prompts, guided)  # warm-up
        timer.per_token_us.clear()
        rates = {"unconstrained": [], "constrained": []}
        for _ in range(args.repeats):
            for name, params in (("unconstrained", plain), ("constrained", guided)):
                tokens, seconds = timed_run(engine, prompts, params)
                rates[name].append(tokens / seconds)
        ratios = [c / u for u, c in zip(rates["unconstrained"], rates["constrained"])]
        row = {"batch": batch, "unconstrained_tok_s": statistics.median(rates["unconstrained"]),
               "constrained_tok_s": statistics.median(rates["constrained"]), "ratio_median": statistics.median(ratios),
               "ratios": ratios, "mask_plus_advance_us": percentiles(timer.per_token_us),
               "compile_ms": compiled.compile_seconds * 1e3}
        rows.append(row)
        m = row["mask_plus_advance_us"]
        print(f"batch {batch:3d}: unconstrained {row['unconstrained_tok_s']:8.1f} tok/s  constrained "
              f"{row['constrained_tok_s']:8.1f} tok/s  ratio {row['ratio_median']:.2f} "
              f"({', '.join(f'{r:.2f}' for r in ratios)})  mask+advance/token p50 {m['p50']:.0f} µs "
              f"p99 {m['p99']:.0f} µs")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["engines", "throughput", "all"], default="all")
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "demo"))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--walks", type=int, default=5, help="random walks per grammar (engines part)")
    ap.add_argument("--walk-length", type=int, default=100)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    results = {"machine": platform.processor() or platform.machine(), "cpus": __import__("os").cpu_count()}
    if args.part in ("engines", "all"):
        results["engines"] = part_engines(args)
    if args.part in ("throughput", "all"):
        results["throughput"] = part_throughput(args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
