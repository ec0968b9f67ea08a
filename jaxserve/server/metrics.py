"""Prometheus metrics of one server, in a registry of its own (never prometheus_client's global one, so two
servers in one process, as in tests, do not share counts). Names mirror vLLM's with the `jaxserve:` prefix
(vllm:num_requests_running -> jaxserve:num_requests_running), so existing dashboards need only a rename.

Two kinds, two places to add more:
  - events (a request finished, was rejected, an HTTP response was sent): declare the metric in
    `ServerMetrics.__init__`, observe it in the `observe_*` method for that event (or add one);
  - engine state (queue lengths, KV usage, engine counters): read at scrape time in `EngineStateCollector.collect`,
    so nothing samples on a timer.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # vLLM's
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineStateCollector(engine, model_name))
        model = ["model_name"]
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens of finished requests.", model,
                                     registry=self.registry)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Generated tokens of finished requests.",
                                         model, registry=self.registry)
        self.request_success = Counter("jaxserve:request_success", "Finished requests by finish reason.",
                                       [*model, "finished_reason"], registry=self.registry)
        self.requests_rejected = Counter("jaxserve:requests_rejected", "Requests refused before reaching the "
                                         "engine (queue_full, draining, engine_dead).", [*model, "reason"],
                                         registry=self.registry)
        self.http_requests = Counter("jaxserve:http_requests", "HTTP responses by route and status.",
                                     ["method", "route", "status"], registry=self.registry)
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds", "Time to first token.", model,
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("jaxserve:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", model, buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("jaxserve:e2e_request_latency_seconds", "Arrival to last token.", model,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_prompt_tokens = Histogram("jaxserve:request_prompt_tokens", "Prompt length per request.",
                                               model, buckets=TOKEN_COUNT_BUCKETS, registry=self.registry)
        self.request_generation_tokens = Histogram("jaxserve:request_generation_tokens", "Generated tokens per "
                                                   "request.", model, buckets=TOKEN_COUNT_BUCKETS,
                                                   registry=self.registry)

    # ---- events -------------------------------------------------------------------------------------------------
    def observe_finished(self, output: RequestOutput) -> None:
        """A request's final output (every sample finished)."""
        name = self.model_name
        generated = sum(len(sample.token_ids) for sample in output.outputs)
        self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(name).inc(generated)
        self.request_prompt_tokens.labels(name).observe(len(output.prompt_token_ids))
        self.request_generation_tokens.labels(name).observe(generated)
        for sample in output.outputs:
            self.request_success.labels(name, sample.finish_reason or "abort").inc()
        self._observe_latencies(output)

    def _observe_latencies(self, output: RequestOutput) -> None:
        m, name = output.metrics, self.model_name
        if m is None or m.first_token_time is None:
            return
        self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
        if m.last_token_time is not None:
            self.e2e.labels(name).observe(m.last_token_time - m.arrival_time)
            longest = max(len(sample.token_ids) for sample in output.outputs)
            if longest > 1:
                self.tpot.labels(name).observe((m.last_token_time - m.first_token_time) / (longest - 1))

    def observe_aborted(self, num_samples: int) -> None:
        """A request whose client went away before it finished."""
        self.request_success.labels(self.model_name, "abort").inc(num_samples)

    def observe_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    def observe_http(self, method: str, route: str, status: int) -> None:
        self.http_requests.labels(method, route, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EngineStateCollector:
    """Engine state, read when Prometheus scrapes. Reads plain counters the engine thread writes: a scrape may
    see a value one step old, never a torn one."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        labels = [self.model_name]
        scheduler = self.engine.engine.scheduler
        yield _gauge("jaxserve:num_requests_running", "Sequences in the running batch.", self.engine.num_running,
                     labels)
        yield _gauge("jaxserve:num_requests_waiting", "Sequences waiting to be scheduled.",
                     self.engine.num_waiting, labels)
        yield _gauge("jaxserve:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).",
                     scheduler.allocator.usage, labels)
        yield _gauge("jaxserve:engine_alive", "1 while the engine loop runs, 0 once it has died.",
                     int(self.engine.is_alive), labels)
        preemptions = CounterMetricFamily("jaxserve:num_preemptions", "Sequences preempted (recomputed later).",
                                          labels=["model_name"])
        preemptions.add_metric(labels, scheduler.num_preemptions)
        yield preemptions

    def describe(self):
        return []


def _gauge(name: str, documentation: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
    gauge.add_metric(labels, value)
    return gauge
