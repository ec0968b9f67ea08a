"""Host cost of output processing per step, along one long stream: flat (O(new tokens)) or growing (O(length))?

Drives the OutputProcessor (jaxserve/engine/output.py) with one request's deltas, one token per step, the way the
engine thread's StepOutputs reach it: a real tokenizer (a test fixture's), incremental detokenization, a stop
string that never matches (so the hold-back path runs), logprobs with 5 alternatives. Prints the mean host time
per step (median) over the first and the last 100 steps and their ratio, per OutputKind, after one warm-up stream; also the step meter's cost
(jaxserve/engine/stats.py StepMeter vs NullMeter) per step, measured the same way on fake steps.

    python bench/output_processing.py [--tokens 4000] [--tokenizer tests/fixtures/tokenizers/llama3_bbpe]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

from jaxserve.engine.messages import SampleDelta, SchedulerStats, StepOutputs
from jaxserve.engine.output import OutputProcessor
from jaxserve.outputs import OutputKind, TokenLogprob
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 100


def stream_times(tokenizer, kind: OutputKind, num_tokens: int, seed: int = 0) -> list[float]:
    """Seconds of OutputProcessor.process per step, for one request generating num_tokens tokens."""
    rng = random.Random(seed)
    vocab = [i for i in range(min(tokenizer.vocab_size, 5000)) if i not in tokenizer.skipped_special_ids]
    params = SamplingParams(max_tokens=num_tokens, logprobs=5, stop=("<<never-seen-stop>>",))
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, tuple(rng.choice(vocab) for _ in range(16)), params, time.monotonic(), kind)
    times = []
    for i in range(num_tokens):
        token_id = rng.choice(vocab)
        top = tuple((rng.choice(vocab), -1.0 - j) for j in range(5))
        last = i == num_tokens - 1
        delta = SampleDelta("r", 0, (token_id,), (TokenLogprob(token_id, -1.0, top),),
                            "length" if last else None)
        step = StepOutputs((delta,), SchedulerStats(), ("r",) if last else (), time.monotonic())
        start = time.perf_counter()
        processor.process(step)
        times.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> dict:
    """Medians (a shared machine's hiccups hit single steps); the last window leaves out the final step."""
    first, last = statistics.median(times[:WINDOW]), statistics.median(times[-WINDOW - 1:-1])
    return {"first_100_us": round(first * 1e6, 2), "last_100_us": round(last * 1e6, 2),
            "last_over_first": round(last / first, 3)}


def meter_cost(steps: int = 20000) -> dict:
    """Per-step seconds of the measurement hook's calls (on fake steps whose device arrays are always ready)."""
    from jaxserve.engine.buckets import StepShape
    from jaxserve.engine.stats import NullMeter, StepMeter
    from jaxserve.scheduler.scheduler import ScheduledSequence, StepPlan

    class Ready:
        def is_ready(self):
            return True

        def block_until_ready(self):
            return self

    @dataclasses.dataclass
    class Pending:
        plan: StepPlan
        shape: StepShape
        sampled: object
        dispatched_at: float = 0.0

    rows = tuple(ScheduledSequence(i, str(i), 0, SamplingParams(), i + 1, 1, 100, True, (1,), False)
                 for i in range(64))
    sampled = type("Sampled", (), {"tokens": Ready()})()
    results = {}
    for meter in (StepMeter(), NullMeter()):
        in_flight = None
        start = time.perf_counter()
        for i in range(steps):
            pending = Pending(StepPlan(i, rows, (), 64), StepShape("decode", 64, 64, 16), sampled)
            meter.step_started(in_flight)
            meter.dispatching(pending.plan)
            meter.dispatched(pending, True)
            if in_flight is not None:
                fetch = meter.fetch_started(in_flight)
                meter.fetch_done(in_flight, fetch)
                meter.step_finished(in_flight)
            in_flight = pending
        results[type(meter).__name__] = (time.perf_counter() - start) / steps * 1e6
    return {"meter_us_per_step_64_rows": round(results["StepMeter"], 2),
            "null_meter_us_per_step": round(results["NullMeter"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--tokenizer", default=str(ROOT / "tests" / "fixtures" / "tokenizers" / "llama3_bbpe"))
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    stream_times(tokenizer, OutputKind.DELTA, 500, seed=1)  # warm-up: the tokenizer's and Python's caches
    for kind in (OutputKind.DELTA, OutputKind.FINAL_ONLY):
        times = stream_times(tokenizer, kind, args.tokens)
        print(json.dumps({"kind": kind.value, "tokens": args.tokens, **summary(times),
                          "total_ms": round(sum(times) * 1e3, 1)}))
    print(json.dumps(meter_cost()))


if __name__ == "__main__":
    main()
