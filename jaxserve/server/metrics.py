"""Prometheus metrics of one server, in a registry of its own (never prometheus_client's global one, so two
servers in one process, as in tests, do not share counts). Names mirror vLLM's with the `jaxserve:` prefix
(vllm:num_requests_running -> jaxserve:num_requests_running), so existing dashboards need only a rename; the
list, and the bottleneck verdict's definitions, are in docs/metrics.md.

Two kinds, two places to add more:
  - events (a request finished, was rejected, an HTTP response was sent): declare the metric in
    `ServerMetrics.__init__`, observe it in the `observe_*` method for that event (or add one);
  - engine state (queue lengths, KV usage, engine counters, the bottleneck verdict): read at scrape time in
    `EngineStateCollector.collect`, so nothing samples on a timer.

Requests and samples, as vLLM counts them: vLLM runs each of a request's n samples as a child request, so every
per-request series (request_success, the latency histograms, the prompt/generation token counters and
histograms, num_requests_running) counts samples, and only request_params_n and
request_max_num_generation_tokens are observed once per request (docs/metrics.md, "n > 1").

`dashboard_snapshot()` gives the /dashboard page the same numbers as JSON, plus latency percentiles over the
samples that finished in the last LATENCY_WINDOW_SECONDS.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxserve.engine.client import EngineClient
from jaxserve.observability.bottleneck import VERDICTS, BottleneckMonitor
from jaxserve.outputs import RequestOutput, SampleMetrics

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # vLLM's
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n
FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("queue_full", "draining", "engine_dead")
LATENCY_WINDOW_SECONDS = 60.0
LATENCY_WINDOW_REQUESTS = 4096


@dataclasses.dataclass(frozen=True)
class RequestTimes:
    """One finished sample's latencies (seconds; None where it has no such interval), as vLLM's child request."""

    finished: float  # time.monotonic()
    ttft: float | None
    tpot: float | None
    e2e: float | None
    queue: float | None


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str, monitor: BottleneckMonitor | None = None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.engine = engine
        self.monitor = monitor or engine.monitor
        self.recent: collections.deque[RequestTimes] = collections.deque(maxlen=LATENCY_WINDOW_REQUESTS)
        self.registry.register(EngineStateCollector(engine, model_name, self.monitor))
        model = ["model_name"]

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(f"jaxserve:{name}", documentation, model, buckets=buckets, registry=self.registry)

        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens of finished samples (n samples of "
                                     "one prompt count it n times, as vLLM's child requests do).", model,
                                     registry=self.registry)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Generated tokens of finished samples.",
                                         model, registry=self.registry)
        self.request_success = Counter("jaxserve:request_success", "Finished samples (vLLM: child requests) by "
                                       "finish reason.", [*model, "finished_reason"], registry=self.registry)
        self.requests_rejected = Counter("jaxserve:requests_rejected", "Requests refused before reaching the "
                                         "engine (queue_full, draining, engine_dead).", [*model, "reason"],
                                         registry=self.registry)
        self.http_requests = Counter("jaxserve:http_requests", "HTTP responses by route and status.",
                                     [*model, "method", "route", "status"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token, per sample.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Every gap between successive tokens of a sample "
                              "(vLLM's deprecated name for inter_token_latency_seconds).", TPOT_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds", "Per sample: (last token - first "
                                      "token) / (tokens - 1).", TPOT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Every gap between successive tokens of a sample.",
                             TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token, per sample.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled, per sample.",
                                    LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token, per "
                                      "sample.", LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token, per sample.",
                                     LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last token, per "
                                        "sample.", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length, per sample.",
                                               TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens, per sample.",
                                                   TOKEN_COUNT_BUCKETS)
        self.max_generation_tokens = histogram("request_max_num_generation_tokens", "Per request: the most "
                                               "tokens any of its n samples generated.", TOKEN_COUNT_BUCKETS)
        self.params_n = histogram("request_params_n", "Per request: its n (samples).", N_BUCKETS)
        for reason in FINISH_REASONS:  # every series exists from the start, so rate() has data (vLLM does too)
            self.request_success.labels(model_name, reason)
        for reason in REJECT_REASONS:
            self.requests_rejected.labels(model_name, reason)

    # ---- events -------------------------------------------------------------------------------------------------
    def observe_finished(self, output: RequestOutput, model_name: str | None = None) -> None:
        """A request's final output (every sample finished): each sample counts as one of vLLM's child
        requests; n and the longest sample once per request. `model_name`: the LoRA adapter it ran with."""
        name = model_name or self.model_name
        prompt_len = len(output.prompt_token_ids)
        samples = output.metrics.samples if output.metrics is not None else ()
        for index, sample in enumerate(output.outputs):
            self.request_success.labels(name, sample.finish_reason or "abort").inc()
            self.prompt_tokens.labels(name).inc(prompt_len)
            self.generation_tokens.labels(name).inc(sample.num_tokens)
            self.request_prompt_tokens.labels(name).observe(prompt_len)
            self.request_generation_tokens.labels(name).observe(sample.num_tokens)
            if index < len(samples):
                self._observe_latencies(output.metrics.arrival_time, samples[index], sample.num_tokens, name)
        self.params_n.labels(name).observe(len(output.outputs))
        self.max_generation_tokens.labels(name).observe(max((s.num_tokens for s in output.outputs), default=0))

    def _observe_latencies(self, arrival: float, m: SampleMetrics, num_tokens: int, name: str) -> None:
        if m.first_token_time is None:
            return
        times = sample_times(arrival, m, num_tokens)
        for value, histogram in ((times.ttft, self.ttft), (times.tpot, self.request_tpot), (times.e2e, self.e2e),
                                 (times.queue, self.queue_time)):
            if value is not None:
                histogram.labels(name).observe(value)
        for gap in m.inter_token_latencies:
            self.itl.labels(name).observe(gap)
            self.tpot.labels(name).observe(gap)
        if m.first_scheduled_time is not None:
            self.prefill_time.labels(name).observe(m.first_token_time - m.first_scheduled_time)
            self.inference_time.labels(name).observe(m.last_token_time - m.first_scheduled_time)
        self.decode_time.labels(name).observe(m.last_token_time - m.first_token_time)
        self.recent.append(times)

    def observe_aborted(self, num_samples: int) -> None:
        """Samples of requests whose client went away before they finished (each is one of vLLM's child
        requests)."""
        self.request_success.labels(self.model_name, "abort").inc(num_samples)

    def observe_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    def observe_http(self, method: str, route: str, status: int) -> None:
        self.http_requests.labels(self.model_name, method, route, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the dashboard --------------------------------------------------------------------------------------
    def dashboard_snapshot(self) -> dict:
        """Everything /dashboard plots, now. Rates are left to the page (differences of the `totals` between
        two polls), so this holds no history but the recent requests' latencies."""
        stats = self.engine.stats()
        report = self.monitor.report()
        cutoff = time.monotonic() - LATENCY_WINDOW_SECONDS
        recent = [t for t in tuple(self.recent) if t.finished >= cutoff]
        ceilings = self.monitor.ceilings
        return {
            "time": time.time(),
            "model": self.model_name,
            "totals": {"steps": stats.totals.steps, "tokens": stats.totals.tokens,
                       "generated_tokens": stats.totals.sampled_tokens},
            "latency_window_seconds": LATENCY_WINDOW_SECONDS,
            "finished_requests": len(recent),  # samples (vLLM's child requests), as the histograms count
            "ttft": percentiles([t.ttft for t in recent]),
            "tpot": percentiles([t.tpot for t in recent]),
            "e2e": percentiles([t.e2e for t in recent]),
            "queue": percentiles([t.queue for t in recent]),
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "preemptions": stats.num_preemptions,
            "spec_decode": {"drafts": stats.spec_decode.num_drafts, "draft_tokens": stats.spec_decode.num_draft_tokens,
                            "accepted_tokens": stats.spec_decode.num_accepted_tokens,
                            "acceptance_rate": stats.spec_decode.acceptance_rate,
                            "mean_accepted_length": stats.spec_decode.mean_accepted_length},
            "bottleneck": {"window_seconds": self.monitor.window_seconds, **report.as_dict()},
            "ceilings": {"device": ceilings.device_kind, "bandwidth": ceilings.bandwidth, "flops": ceilings.flops,
                         "dtype": ceilings.dtype, "source": ceilings.source,
                         "devices": self.monitor.cost.num_devices},
            "engine_alive": self.engine.is_alive,
        }


def sample_times(arrival: float, m: SampleMetrics, num_tokens: int) -> RequestTimes:
    last = m.last_token_time
    return RequestTimes(
        finished=time.monotonic(), ttft=m.first_token_time - arrival,
        tpot=(last - m.first_token_time) / (num_tokens - 1) if last is not None and num_tokens > 1 else None,
        e2e=last - arrival if last is not None else None,
        queue=m.first_scheduled_time - arrival if m.first_scheduled_time is not None else None)


def percentiles(values, qs=(50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles of the values that are not None (None when there are none)."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": data[min(len(data) - 1, max(0, -(-q * len(data) // 100) - 1))] for q in qs}


class EngineStateCollector:
    """Engine state, read when Prometheus scrapes: the engine client's latest stats snapshot (frozen, at most a
    step old) and the bottleneck monitor."""

    def __init__(self, engine: EngineClient, model_name: str, monitor: BottleneckMonitor):
        self.engine = engine
        self.model_name = model_name
        self.monitor = monitor

    def collect(self):
        labels = [self.model_name]
        stats = self.engine.stats()
        yield _gauge("jaxserve:num_requests_running", "Sequences in the running batch.", stats.num_running, labels)
        yield _gauge("jaxserve:num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting,
                     labels)
        yield _gauge("jaxserve:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).",
                     stats.kv_cache_usage, labels)
        yield _gauge("jaxserve:gpu_cache_usage_perc", "The same as kv_cache_usage_perc (vLLM's older name).",
                     stats.kv_cache_usage, labels)
        yield _gauge("jaxserve:num_requests_swapped", "Always 0: jaxserve never swaps KV pages to host memory "
                     "(a preempted sequence is recomputed); vLLM's older dashboards plot it.", 0, labels)
        yield self._cache_config_info(labels)
        yield self._iteration_tokens(labels)
        yield _gauge("jaxserve:engine_alive", "1 while the engine loop runs, 0 once it has died.",
                     int(self.engine.is_alive), labels)
        yield _gauge("jaxserve:lora_adapters_loaded", "LoRA adapters requests may name (requests per adapter: "
                     "the request counters' model_name label).", len(self.engine.loras()), labels)
        yield _counter("jaxserve:num_preemptions", "Sequences preempted (recomputed later).", stats.num_preemptions,
                       labels)
        yield _counter("jaxserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       stats.prefix_cache_queries, labels)
        yield _counter("jaxserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       stats.prefix_cache_hits, labels)
        yield from self._step_counters(stats, labels)
        yield from _spec_decode_counters(stats.spec_decode, labels)
        yield from self._bottleneck(labels)

    def _cache_config_info(self, labels):
        names = [name for name, _ in self.engine.info.cache_config]
        info = GaugeMetricFamily("jaxserve:cache_config_info", "The KV cache's settings as labels (vLLM's "
                                 "cache_config_info); the value is 1.", labels=["model_name", *names])
        info.add_metric([*labels, *(value for _, value in self.engine.info.cache_config)], 1)
        return info

    def _iteration_tokens(self, labels):
        sizes = self.monitor.step_sizes()
        buckets = [(str(float(le)), count) for le, count in zip(sizes.buckets, sizes.cumulative)]
        histogram = HistogramMetricFamily("jaxserve:iteration_tokens_total", "Real (unpadded) tokens per engine "
                                          "step: prompt chunks and decode tokens.", labels=["model_name"])
        histogram.add_metric(labels, [*buckets, ("+Inf", sizes.count)], sizes.sum)
        return histogram

    def _step_counters(self, stats, labels):
        totals = stats.totals
        yield _counter("jaxserve:engine_steps", "Model steps run.", totals.steps, labels)
        yield _counter("jaxserve:device_busy_seconds", "Device time of the steps (docs/metrics.md).",
                       totals.device_seconds, labels)
        yield _counter("jaxserve:device_idle_seconds", "Time the device sat idle waiting for the host while the "
                       "engine had work.", totals.host_gap_seconds, labels)
        work = self.monitor.total_work(totals)
        moved = CounterMetricFamily("jaxserve:step_bytes", "Bytes the steps had to move (the floor: weights once "
                                    "per step, KV read and written).", labels=["model_name", "kind"])
        for kind, value in (("weights", work.weight_bytes), ("kv_read", work.kv_read_bytes),
                            ("kv_write", work.kv_write_bytes)):
            moved.add_metric([*labels, kind], value)
        yield moved
        yield _counter("jaxserve:step_flops", "FLOPs the steps had to do.", work.flops, labels)

    def _bottleneck(self, labels):
        report, ceilings = self.monitor.report(), self.monitor.ceilings
        verdict = GaugeMetricFamily("jaxserve:bottleneck", "1 for the current bottleneck verdict over the "
                                    "sliding window (compute, bandwidth, capacity, host; idle: no steps).",
                                    labels=["model_name", "verdict"])
        for name in VERDICTS:
            verdict.add_metric([*labels, name], int(name == report.verdict))
        yield verdict
        for name, value, doc in (
                ("bandwidth_fraction", report.bandwidth_fraction, "Achieved bytes/s over device time, as a "
                 "fraction of the device's copy bandwidth."),
                ("compute_fraction", report.compute_fraction, "Achieved FLOP/s over device time, as a fraction of "
                 "the device's matmul FLOP/s."),
                ("idle_fraction", report.idle_fraction, "Share of the engine's busy time the device sat idle "
                 "waiting for the host."),
                ("capacity_fraction", report.capacity_fraction, "Share of steps planned while requests waited "
                 "for KV-cache pages."),
                ("window_seconds", self.monitor.window_seconds, "The sliding window of the verdict.")):
            yield _gauge(f"jaxserve:bottleneck_{name}", doc, value, labels)
        yield _gauge("jaxserve:device_achieved_bandwidth_bytes_per_second", "Bytes moved per second of device "
                     "time over the window, all devices.", report.achieved_bandwidth, labels)
        yield _gauge("jaxserve:device_achieved_flops_per_second", "FLOPs per second of device time over the "
                     "window, all devices.", report.achieved_flops, labels)
        yield _gauge("jaxserve:device_bandwidth_ceiling_bytes_per_second", "Copy bandwidth of one device "
                     "(measured at start-up, or the datasheet's).", ceilings.bandwidth, labels)
        yield _gauge("jaxserve:device_flops_ceiling_per_second", f"Matmul FLOP/s of one device in "
                     f"{ceilings.dtype} (measured at start-up, or the datasheet's).", ceilings.flops, labels)
        yield _gauge("jaxserve:num_devices", "Devices each engine replica runs on.", self.monitor.cost.num_devices,
                     labels)

    def describe(self):
        return []


def _spec_decode_counters(spec, labels):
    """Speculative decoding, with vLLM's names (docs/metrics.md); all zero when it is off."""
    yield _counter("jaxserve:spec_decode_num_drafts", "Verify rows that carried proposals.", spec.num_drafts, labels)
    yield _counter("jaxserve:spec_decode_num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens, labels)
    yield _counter("jaxserve:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens,
                   labels)
    per_position = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, "
                                       "by position among a row's proposals (0 = first).",
                                       labels=["model_name", "position"])
    for position, count in enumerate(spec.accepted_per_position):
        per_position.add_metric([*labels, str(position)], count)
    yield per_position


def _gauge(name: str, documentation: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
    gauge.add_metric(labels, value)
    return gauge


def _counter(name: str, documentation: str, value: float, labels: list[str]) -> CounterMetricFamily:
    counter = CounterMetricFamily(name, documentation, labels=["model_name"])
    counter.add_metric(labels, value)
    return counter
