"""A bounded soak of `jaxserve serve`: mixed traffic for a fixed time, then a verdict on what must not drift.

    python bench/soak.py --duration 600 --concurrency 8                  # starts `jaxserve serve` (demo model)
    python bench/soak.py --model DIR --serve-args "--max-num-seqs 16"   # another checkpoint, more flags
    python bench/soak.py --url http://127.0.0.1:8000 --pid 1234          # a server already running

Each of --concurrency workers loops until --duration: it picks a request kind at random (seeded) and checks the
answer it must get:
    completion       non-streamed, sometimes logprobs, a stop string, n = 2               200
    stream           streamed completion, sometimes n = 2 and logprobs, read to [DONE]    200
    chat             chat completion, streamed or not                                     200
    disconnect       a stream dropped after its second event                              200 (then dropped)
    bad              one of BAD_REQUESTS (ranges, types, surrogates, a prompt too long)   400
    tokenize         /tokenize                                                            200
A 429 (queue full) is expected under load and counted apart; anything else is an unexpected error: a status that
is not the one the kind must get, a 5xx, a broken stream, a transport error.

The verdict (--check exits 1 when one fails): 0 unexpected errors; p99 latency of the requests that ended in the
last window within 1.3x the first window's (window = a minute, or a quarter of a shorter run; latency of the
non-streamed completion and chat requests, whose work is fixed); server RSS at the end within 10% of its RSS after
the first window (the warm-up: caches and pools filled); KV cache usage 0 once the server is idle again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

DEMO_MODEL = Path(__file__).resolve().parents[1] / "checkpoints" / "demo"
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "top_k": 2**31, "temperature": 1.0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 2**31}),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("/v1/completions", {"prompt": "a\ud800b"}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\ud800": 1}}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}),
    ("/v1/completions", {"prompt": "x " * 5000}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/completions", {"prompt": "x", "n": 1000}),
]
PROMPTS = ["The river ran", "Once upon a time", "The engineer wrote a test first, and", "Hello", "A list of colours:"]
LATENCY_KINDS = ("completion", "chat")
KINDS = ("completion", "stream", "chat", "disconnect", "bad", "tokenize")
WEIGHTS = (4, 4, 3, 2, 2, 1)


class Soak:
    def __init__(self, url: str, pid: int | None, duration: float, concurrency: int, max_tokens: int, seed: int):
        self.url, self.pid, self.duration, self.concurrency = url, pid, duration, concurrency
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.results: list[dict] = []  # kind, end (seconds since start), latency, status, ok
        self.unexpected: list[str] = []
        self.rss: list[tuple[float, int]] = []
        self.start = 0.0

    async def run(self) -> dict:
        self.start = time.monotonic()
        limits = httpx.Limits(max_connections=self.concurrency * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as client:
            workers = [asyncio.create_task(self.worker(client, i)) for i in range(self.concurrency)]
            sampler = asyncio.create_task(self.sample_rss())
            await asyncio.gather(*workers)
            sampler.cancel()
            kv = await self.idle_kv_usage(client)
        self.rss.append((time.monotonic() - self.start, self.server_rss()))
        return self.report(kv)

    async def worker(self, client: httpx.AsyncClient, index: int) -> None:
        rng = random.Random(self.rng.random())
        while time.monotonic() - self.start < self.duration:
            kind = rng.choices(KINDS, WEIGHTS)[0]
            began = time.monotonic()
            try:
                status, problem = await getattr(self, kind)(client, rng)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                status, problem = 0, f"{type(exc).__name__}: {exc}"
            end = time.monotonic()
            ok = problem is None
            if not ok and status != 429:
                self.unexpected.append(f"{kind}: {problem}")
            self.results.append({"kind": kind, "end": end - self.start, "latency": end - began, "status": status,
                                 "ok": ok})

    # ---- the kinds: each returns (status, problem or None) ---------------------------------------------------
    def completion_body(self, rng: random.Random) -> dict:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": self.max_tokens, "temperature": rng.choice([0, 0.8]),
                "seed": rng.randrange(1000)}
        if rng.random() < 0.3:
            body["logprobs"] = rng.randrange(0, 4)
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(["\n", ".", "the"])]
        if rng.random() < 0.2:
            body["n"] = 2
        return body

    async def completion(self, client, rng):
        response = await client.post("/v1/completions", json=self.completion_body(rng))
        return self.expect(response, 200, lambda r: len(r.json()["choices"]) >= 1)

    async def stream(self, client, rng):
        body = {**self.completion_body(rng), "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return self.expect(response, 200)
            lines = [line async for line in response.aiter_lines() if line]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        failed = next((event["error"] for event in events if "error" in event), None)
        if not lines or lines[-1] != "data: [DONE]" or failed is not None:
            return 200, f"broken stream: {failed or lines[-2:]}"
        return 200, None

    async def chat(self, client, rng):
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": self.max_tokens,
                "temperature": 0.7, "seed": rng.randrange(1000), "logprobs": rng.random() < 0.3}
        response = await client.post("/v1/chat/completions", json=body)
        return self.expect(response, 200, lambda r: r.json()["choices"][0]["message"]["role"] == "assistant")

    async def disconnect(self, client, rng):
        body = {**self.completion_body(rng), "stream": True, "max_tokens": 4 * self.max_tokens, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return self.expect(response, 200)
            events = 0
            async for line in response.aiter_lines():
                events += bool(line)
                if events == 2:
                    break  # leaving the block closes the connection mid-stream
        return 200, None

    async def bad(self, client, rng):
        path, body = rng.choice(BAD_REQUESTS)
        response = await client.post(path, content=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return self.expect(response, 400, lambda r: r.json()["error"]["message"])

    async def tokenize(self, client, rng):
        response = await client.post("/tokenize", json={"prompt": rng.choice(PROMPTS)})
        return self.expect(response, 200, lambda r: r.json()["count"] > 0)

    @staticmethod
    def expect(response: httpx.Response, status: int, check=None) -> tuple[int, str | None]:
        if response.status_code != status:
            return response.status_code, f"status {response.status_code} (expected {status}): {response.text[:200]}"
        if check is not None and not check(response):
            return response.status_code, f"unexpected body: {response.text[:200]}"
        return response.status_code, None

    # ---- measurements ---------------------------------------------------------------------------------------
    def server_rss(self) -> int:
        return psutil.Process(self.pid).memory_info().rss if self.pid else 0

    async def sample_rss(self) -> None:
        while True:
            self.rss.append((time.monotonic() - self.start, self.server_rss()))
            await asyncio.sleep(5)

    async def idle_kv_usage(self, client: httpx.AsyncClient, timeout: float = 120) -> float:
        """KV usage once nothing runs or waits (aborted streams free their pages at the next step)."""
        deadline = time.monotonic() + timeout
        while True:
            text = (await client.get("/metrics")).text
            values = {name: float(value) for name, value in re.findall(
                r"^jaxserve:(kv_cache_usage_perc|num_requests_running|num_requests_waiting)\{[^}]*\} (\S+)$",
                text, re.M)}
            if not values.get("num_requests_running") and not values.get("num_requests_waiting") \
                    or time.monotonic() > deadline:
                return values.get("kv_cache_usage_perc", -1.0)
            await asyncio.sleep(0.5)

    def report(self, kv_usage: float) -> dict:
        window = min(60.0, self.duration / 4)
        timed = [r for r in self.results if r["ok"] and r["kind"] in LATENCY_KINDS]
        first = [r["latency"] for r in timed if r["end"] <= window]
        last = [r["latency"] for r in timed if r["end"] >= self.duration - window]
        warm_rss = next((rss for t, rss in self.rss if t >= window), self.rss[0][1] if self.rss else 0)
        report = {
            "duration_s": self.duration, "concurrency": self.concurrency, "requests": len(self.results),
            "by_kind": {kind: sum(r["kind"] == kind for r in self.results) for kind in KINDS},
            "queue_full_429": sum(r["status"] == 429 for r in self.results),
            "unexpected_errors": len(self.unexpected), "unexpected_examples": self.unexpected[:5],
            "window_s": window, "p99_first_window_s": percentile(first, 99), "p99_last_window_s": percentile(last, 99),
            "rss_after_warmup_mib": warm_rss / 2**20, "rss_end_mib": self.rss[-1][1] / 2**20 if self.rss else 0.0,
            "kv_cache_usage_end": kv_usage,
        }
        report["p99_ratio"] = report["p99_last_window_s"] / max(report["p99_first_window_s"], 1e-9)
        report["rss_growth"] = report["rss_end_mib"] / max(report["rss_after_warmup_mib"], 1e-9) - 1
        report["passed"] = (report["unexpected_errors"] == 0 and report["p99_ratio"] <= 1.3
                            and (not self.pid or report["rss_growth"] < 0.10) and kv_usage == 0.0)
        return report


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def start_server(model: str, serve_args: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", model, "--port", str(port),
               "--log-level", "warning", *shlex.split(serve_args)]
    process = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not start; see {log_path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: start `jaxserve serve`)")
    parser.add_argument("--pid", type=int, help="the running server's process id, for its RSS")
    parser.add_argument("--model", default=str(DEMO_MODEL), help="checkpoint to serve (default: the demo model)")
    parser.add_argument("--serve-args", default="", help="extra `jaxserve serve` flags, one string")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default: 600)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default: 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here too")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the verdict passes")
    args = parser.parse_args(argv)
    process = None
    url, pid = args.url, args.pid
    if url is None:
        process, url = start_server(args.model, args.serve_args, Path(args.json or "soak").with_suffix(".log"))
        pid = process.pid
    try:
        report = asyncio.run(Soak(url, pid, args.duration, args.concurrency, args.max_tokens, args.seed).run())
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if report["passed"] or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
