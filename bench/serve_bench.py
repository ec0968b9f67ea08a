"""Load generator for any OpenAI-compatible server (jaxserve, vLLM, TGI, ...): streams requests, reports throughput
and latency with the definitions of vLLM's benchmark_serving, writes JSON.

    python bench/serve_bench.py --base-url http://127.0.0.1:8000 --model NAME \\
        --dataset random --input-len 128 --output-len 64 --num-prompts 200 --request-rate 8 --max-concurrency 32

Workloads:
  random          /v1/completions with prompts of exactly --input-len random token ids (ids in [3, --vocab-size),
                  default [3, 256): every byte-level or byte-fallback vocabulary has them). Servers that take
                  token-id prompts (jaxserve, vLLM) see the exact length.
  synthetic-chat  /v1/chat/completions with a user message of --input-len random words (about that many tokens;
                  the report uses the server's usage.prompt_tokens).
Every request asks for exactly --output-len tokens (max_tokens plus ignore_eos, which OpenAI ignores).

Arrivals: Poisson at --request-rate requests/s (inf: all at once), optionally capped at --max-concurrency in
flight. Seeds fix the prompts and the arrival times.

Metrics (per vLLM): TTFT = first non-empty content chunk - request sent; E2EL = last byte - request sent;
TPOT = (E2EL - TTFT) / (output tokens - 1) per request with more than one output token; ITL = gaps between
successive content chunks (a chunk holding several tokens counts once); mean, median, p99 of each (ms).
Throughputs divide by the wall time from the first request sent to the last response finished.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river engine model token cache batch server queue page "
         "kernel stream prompt answer question system memory device").split()


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


# ---- workloads ----------------------------------------------------------------------------------------------
def random_token_prompts(num: int, input_len: int, vocab_size: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, vocab_size) for _ in range(input_len)] for _ in range(num)]


def synthetic_chats(num: int, input_len: int, rng: random.Random) -> list[list[dict]]:
    return [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(input_len))}]
            for _ in range(num)]


def request_body(args: argparse.Namespace, prompt) -> tuple[str, dict]:
    common = {"model": args.model, "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0,
              "stream": True, "stream_options": {"include_usage": True}}
    if args.dataset == "random":
        return "/v1/completions", {**common, "prompt": prompt}
    return "/v1/chat/completions", {**common, "messages": prompt}


# ---- one request --------------------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, path: str, body: dict) -> RequestResult:
    result = RequestResult(ok=False)
    started = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not _content(chunk):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - started
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
        result.latency = time.perf_counter() - started
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _content(chunk: dict) -> str:
    for choice in chunk.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            return text
    return ""


# ---- arrivals -----------------------------------------------------------------------------------------------
def arrival_gaps(num: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), or none for rate inf."""
    if rate == float("inf"):
        return [0.0] * num
    return [rng.expovariate(rate) for _ in range(num)]


async def run_load(args: argparse.Namespace, prompts: list) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=args.max_concurrency or len(prompts), max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    gate = asyncio.Semaphore(args.max_concurrency or len(prompts))
    gaps = arrival_gaps(len(prompts), args.request_rate, random.Random(args.seed + 1))

    async def one(client, prompt) -> RequestResult:
        async with gate:
            return await send(client, *request_body(args, prompt))

    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits,
                                 headers=headers) as client:
        started = time.perf_counter()
        tasks = []
        for gap, prompt in zip(gaps, prompts):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, prompt)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - started


# ---- report -------------------------------------------------------------------------------------------------
def summary(values_s: list[float]) -> dict:
    """mean, median, p99 and std in milliseconds (zeros when there is nothing to summarise)."""
    if not values_s:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0, "std_ms": 0.0}
    ms = sorted(v * 1000 for v in values_s)
    return {"mean_ms": statistics.fmean(ms), "median_ms": statistics.median(ms), "p99_ms": percentile(ms, 99),
            "std_ms": statistics.pstdev(ms)}


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(sorted_values) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def report(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "client_machine": f"{platform.node()} {platform.machine()} {platform.system()}",
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput_per_s": len(done) / duration,
        "output_token_throughput_per_s": output_tokens / duration,
        "total_token_throughput_per_s": (input_tokens + output_tokens) / duration,
        "ttft": summary([r.ttft for r in done]), "tpot": summary(tpots),
        "itl": summary([gap for r in done for gap in r.itl]), "e2el": summary([r.latency for r in done]),
    }


def print_report(result: dict) -> None:
    print(f"completed {result['completed']} requests ({result['failed']} failed) in {result['duration_s']:.2f} s")
    for error in result["errors"]:
        print(f"  error: {error}")
    print(f"request throughput      {result['request_throughput_per_s']:10.2f} req/s")
    print(f"output token throughput {result['output_token_throughput_per_s']:10.2f} tok/s")
    print(f"total token throughput  {result['total_token_throughput_per_s']:10.2f} tok/s")
    print(f"{'':8}{'mean ms':>12}{'median ms':>12}{'p99 ms':>12}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = result[name]
        print(f"{name.upper():8}{s['mean_ms']:12.2f}{s['median_ms']:12.2f}{s['p99_ms']:12.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", required=True, help="model name the server serves (see GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--dataset", choices=("random", "synthetic-chat"), default="random")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (words for synthetic-chat)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--vocab-size", type=int, default=256, help="random token ids are drawn from [3, vocab-size)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--result-file", type=Path, default=None, help="write the JSON report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    prompts = (random_token_prompts(args.num_prompts, args.input_len, args.vocab_size, rng)
               if args.dataset == "random" else synthetic_chats(args.num_prompts, args.input_len, rng))
    results, duration = asyncio.run(run_load(args, prompts))
    result = report(args, results, duration)
    print_report(result)
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
