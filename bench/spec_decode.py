#!/usr/bin/env python3
"""Speculative decoding: output tokens/s with and without it, acceptance rate and mean accepted length, in one run.

    oracle   the `small` architecture of ../shared/peers (random weights, float32), batch 1, K = 4, proposals
             replayed from a plain greedy run of the same prompt: they are always right, so the ratio measures the
             verify path itself (a K + 1 token step against K + 1 decode steps), whatever a proposer's quality
    demo     checkpoints/demo, batch 1 (one request at a time), greedy, prompts cut from the Python files of its
             held-out split: n-gram proposals and the bundled draft model (checkpoints/demo-draft) against plain
             decoding
    batch    checkpoints/demo, 64 requests at once: n-gram and draft with the default
             --speculative-disable-batch-size against plain decoding (speculation must not slow a large batch)
    cutoff   checkpoints/demo, n-gram never disabled against plain at batch 1..32: where speculation stops paying
             (the default --speculative-disable-batch-size comes from it)
    ngram    the n-gram proposer's host cost per proposal on a long history

The draft is checkpoints/demo-draft, or the checkpoint in $JAXSERVE_DEMO_DRAFT (e.g. a random model of another
shape, to price the draft's passes apart from its acceptance).

Engines of a comparison live in one process and run interleaved (A, B, A, B, ...), so a noisy shared machine
slows both alike; each row reports the median of the repeats.

    PYTHONPATH=$PWD python bench/spec_decode.py                       # every section
    PYTHONPATH=$PWD python bench/spec_decode.py --sections oracle --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import load_model
from jaxserve.config import EngineConfig, ModelConfig, RopeConfig
from jaxserve.engine.engine import EngineCore, LLMEngine
from jaxserve.models.llama import random_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec.ngram import NgramProposer
from jaxserve.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "checkpoints" / "demo"
DEMO_DRAFT = Path(os.environ.get("JAXSERVE_DEMO_DRAFT", ROOT / "checkpoints" / "demo-draft"))
SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=768, intermediate_size=2048,
                    num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, max_position_embeddings=8192,
                    rope=RopeConfig(), dtype="float32")  # the peers' `small` (make_models.py), random weights


class ReplayProposer:
    """Benchmark only: proposes the tokens a recorded greedy run produced after the same prompt."""

    def __init__(self, recorded: dict[tuple[int, ...], list[int]]):
        self.recorded = recorded

    def propose(self, seq, k):
        done = seq.num_output_tokens
        return tuple(self.recorded[tuple(seq.token_ids[:seq.num_prompt_tokens])][done:done + k])


def generate(engine: LLMEngine, prompts, params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Submits every prompt at once, steps to the end; (seconds, output token ids per prompt)."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{time.perf_counter_ns()}-{i}", prompt, params)
    finals = sorted(engine.run_until_done(), key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in finals]


def one_at_a_time(engine: LLMEngine, prompts, params) -> tuple[float, list[list[int]]]:
    seconds, outputs = 0.0, []
    for prompt in prompts:
        s, out = generate(engine, [prompt], params)
        seconds += s
        outputs += out
    return seconds, outputs


def compare(engines: dict[str, LLMEngine], run, repeats: int) -> dict[str, dict]:
    """Interleaved repeats of run(engine) -> (seconds, outputs); tok/s (median), speculation counts (last run)."""
    rows = {name: {"tok_s": []} for name in engines}
    outputs = {}
    for _ in range(repeats):
        for name, engine in engines.items():
            snapshot = engine.core.stats_snapshot()
            before, totals = snapshot.spec_decode, snapshot.totals
            seconds, outputs[name] = run(engine)
            snapshot = engine.core.stats_snapshot()
            after = snapshot.spec_decode
            rows[name]["tok_s"].append(sum(map(len, outputs[name])) / seconds)
            busy = snapshot.totals.device_seconds - totals.device_seconds
            idle = snapshot.totals.host_gap_seconds - totals.host_gap_seconds
            steps = snapshot.totals.steps - totals.steps
            rows[name].update(steps=steps, ms_per_step=round(1e3 * busy / steps, 2) if steps else None,
                              device_idle_fraction=round(idle / (busy + idle), 3) if busy + idle else None)
            drafted = after.num_draft_tokens - before.num_draft_tokens
            rows[name].update(
                verify_rows=after.num_drafts - before.num_drafts, draft_tokens=drafted,
                acceptance=(after.num_accepted_tokens - before.num_accepted_tokens) / drafted if drafted else None,
                mean_accepted_length=(1 + (after.num_accepted_tokens - before.num_accepted_tokens)
                                      / (after.num_drafts - before.num_drafts)) if drafted else None)
    for name, row in rows.items():
        row["tok_s_runs"] = [round(v, 1) for v in row["tok_s"]]
        row["tok_s"] = round(statistics.median(row["tok_s"]), 1)
        row["same_tokens_as_plain"] = outputs[name] == outputs["plain"]
    return rows


def report(section: str, rows: dict[str, dict], **facts) -> dict:
    base = rows["plain"]["tok_s"]
    for name, row in rows.items():
        row["vs_plain"] = round(row["tok_s"] / base, 2)
        acc = row.get("acceptance")
        length = row.get("mean_accepted_length")
        acc, length = ("-" if v is None else f"{v:.2f}" for v in (acc, length))
        print(f"  {section:7s} {name:10s} {row['tok_s']:8.1f} tok/s  {row['vs_plain']:5.2f}x  acceptance {acc}  "
              f"mean accepted length {length}  steps {row['steps']} ({row['ms_per_step']} ms)  device idle {row['device_idle_fraction']}  "
              f"same tokens: {row['same_tokens_as_plain']}", flush=True)
    result = {"section": section, **facts, "rows": rows}
    print(json.dumps(result), flush=True)
    return result


def oracle(args) -> dict:
    model = random_model(SMALL, jnp.float32, seed=0)
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=args.input_len, max_model_len=512, page_size=16,
                          decode_buckets=(1,), prefill_token_buckets=(args.input_len,), context_buckets=(512,),
                          kv_cache_memory=2**26, compilation_cache_dir="")
    plain = LLMEngine(model, config, show_progress=False)
    spec = LLMEngine(model, config.replace(speculative_method="ngram", num_speculative_tokens=4), show_progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, SMALL.vocab_size, args.input_len).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    _, recorded = generate(plain, prompts, params)
    spec.core.scheduler.proposer = ReplayProposer({tuple(p): out for p, out in zip(prompts, recorded)})
    rows = compare({"plain": plain, "oracle-K4": spec}, lambda e: generate(e, prompts, params), args.repeats)
    return report("oracle", rows, model="small (peers' architecture, random weights, float32)", batch=1, k=4,
                  input_len=args.input_len, output_len=args.output_len)


def demo_prompts(count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from the middle of held-out Python files (checkpoints/train_demo.py)."""
    sys.path.insert(0, str(ROOT / "checkpoints"))
    from train_demo import load_corpus

    tokenizer = load_tokenizer(DEMO)
    prompts = []
    for text in load_corpus().heldout:
        ids = tokenizer.encode(text)
        if len(ids) >= 4 * length:
            middle = len(ids) // 2
            prompts.append(ids[middle:middle + length])
        if len(prompts) == count:
            return prompts
    raise RuntimeError("too few long held-out files")


def demo_engines(max_num_seqs: int, methods: list[tuple[str, int]]) -> dict[str, LLMEngine]:
    model = load_model(DEMO, dtype="float32")
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=256,
                          compilation_cache_dir="")
    engines = {"plain": LLMEngine(model, config, show_progress=False)}
    tokenizer = load_tokenizer(DEMO)  # the draft's is checked against it
    for method, k in methods:
        draft = str(DEMO_DRAFT) if method == "draft" else None
        engines[f"{method}-K{k}"] = LLMEngine.from_core(EngineCore(
            model, config.replace(speculative_method=method, num_speculative_tokens=k, speculative_model=draft),
            tokenizer, show_progress=False))
    return engines


def demo(args) -> dict:
    engines = demo_engines(1, [(method, k) for method in args.methods for k in args.k])
    prompts = demo_prompts(args.num_prompts, 96)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    rows = compare(engines, lambda e: one_at_a_time(e, prompts, params), args.repeats)
    return report("demo", rows, model="checkpoints/demo", draft="checkpoints/demo-draft", batch=1,
                  prompts=len(prompts), input_len=96, output_len=128)


def batch(args) -> dict:
    engines = demo_engines(64, [(method, 3) for method in args.methods])
    prompts = demo_prompts(64, 96)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    rows = compare(engines, lambda e: generate(e, prompts, params), args.repeats)
    return report("batch", rows, model="checkpoints/demo", batch=64, input_len=96, output_len=128,
                  disable_batch_size=EngineConfig().speculative_disable_batch_size)


def ngram_cost(args) -> dict:
    """Microseconds per proposal on a 4096-token history growing by 1..4 tokens between proposals."""
    rng = np.random.default_rng(0)

    class Seq:
        token_ids = rng.integers(0, 200, 4096).tolist()

    firsts = []  # a sequence's first proposal indexes its whole history
    for _ in range(10):
        proposer, seq = NgramProposer(1, 4), Seq()
        seq.token_ids = rng.integers(0, 200, 4096).tolist()
        start = time.perf_counter()
        proposer.propose(seq, 4)
        firsts.append(time.perf_counter() - start)
    times = []
    for _ in range(2000):
        seq.token_ids.extend(rng.integers(0, 200, int(rng.integers(1, 5))).tolist())
        start = time.perf_counter()
        proposer.propose(seq, 4)
        times.append(time.perf_counter() - start)
    result = {"section": "ngram", "history": 4096, "first_proposal_ms_min": round(min(firsts) * 1e3, 2),
              "first_proposal_ms_median": round(statistics.median(firsts) * 1e3, 2),
              "per_step_us_median": round(statistics.median(times) * 1e6, 2),
              "per_step_us_p99": round(float(np.percentile(times, 99)) * 1e6, 2)}
    print(json.dumps(result), flush=True)
    return result


def cutoff(args) -> dict:
    """Where speculation stops paying: n-gram (never disabled) against plain at growing batch sizes, the
    measurement behind the default --speculative-disable-batch-size."""
    results = {}
    sizes = args.cutoff_batch_sizes
    model = load_model(DEMO, dtype="float32")
    config = EngineConfig(max_num_seqs=max(sizes), max_num_batched_tokens=512, max_model_len=256,
                          compilation_cache_dir="")
    engines = {"plain": LLMEngine(model, config, show_progress=False),
               "ngram-K3": LLMEngine(model, config.replace(speculative_method="ngram", num_speculative_tokens=3,
                                                           speculative_disable_batch_size=None),
                                     show_progress=False)}
    all_prompts = demo_prompts(max(sizes), 96)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for size in sizes:
        rows = compare(engines, lambda e: generate(e, all_prompts[:size], params), args.repeats)
        results[size] = report(f"B={size}", rows, model="checkpoints/demo", batch=size)
    return {"section": "cutoff", "batches": results}


SECTIONS = {"ngram": ngram_cost, "oracle": oracle, "demo": demo, "batch": batch, "cutoff": cutoff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS),
                        default=["ngram", "oracle", "demo", "batch"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128, help="oracle section prompt length")
    parser.add_argument("--output-len", type=int, default=128, help="oracle section output length")
    parser.add_argument("--num-prompts", type=int, default=8, help="demo section prompts (one at a time)")
    parser.add_argument("--k", type=int, nargs="+", default=[3], help="demo section: K values")
    parser.add_argument("--methods", nargs="+", choices=["ngram", "draft"], default=["ngram", "draft"],
                        help="demo and batch sections: the proposers compared with plain decoding")
    parser.add_argument("--cutoff-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--out", help="append the JSON results here")
    args = parser.parse_args()
    results = [SECTIONS[name](args) for name in args.sections]
    if args.out:
        with open(args.out, "a") as fh:
            for r in results:
                fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
