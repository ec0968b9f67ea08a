"""The parts of the bottleneck accounting, by hand: step clocks and device/idle time, the cost model, the verdict
rules, the windowed monitor, the device-ceilings cache and fallback, and the scheduler's page-stall flag."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from fakes import FakeDevice
from jaxserve.config import ModelConfig
from jaxserve.engine.buckets import StepShape
from jaxserve.engine.stats import SAMPLE_INTERVAL, EngineStats, StepClock, StepRecord, StepTotals, attention_work
from jaxserve.kv.allocator import PageAllocator
from jaxserve.observability import ceilings as ceilings_module
from jaxserve.observability.bottleneck import BottleneckMonitor, classify, window_report
from jaxserve.observability.ceilings import CACHE_FILE, DeviceCeilings, device_ceilings, si_rate
from jaxserve.observability.cost import ModelCost
from jaxserve.quant.memory import weight_bytes
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import Scheduler, SchedulerConfig
from jaxserve.server.metrics import percentiles

DECODE = StepShape("decode", 4, 4, 16)
PREFILL = StepShape("prefill", 64, 4, 16)
CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
CEILINGS = DeviceCeilings("test", "float32", bandwidth=1e9, flops=1e10, source="given")


def record(dispatched: float, ready: float, exact: bool = True, shape: StepShape = DECODE, **kw) -> StepRecord:
    return StepRecord(shape, kw.pop("tokens", 4), kw.pop("seqs", 4), dispatched, ready, 0.0,
                      dispatch_started=dispatched, ready_at=ready, end_exact=exact, **kw)


# ---- device time and idle time --------------------------------------------------------------------------------
def test_synchronous_steps_are_measured_and_the_gaps_between_them_are_host_time():
    stats = EngineStats()
    stats.work_arrived(0.0)
    a = stats.record(record(1.0, 3.0))
    b = stats.record(record(4.0, 5.5))
    assert (a.device_seconds, a.host_gap) == (2.0, 1.0)  # 1 s from the work's arrival to the first dispatch
    assert (b.device_seconds, b.host_gap) == (1.5, 1.0)
    assert stats.totals.device_seconds == 3.5 and stats.totals.host_gap_seconds == 2.0


def test_back_to_back_steps_start_when_the_previous_one_ends():
    stats = EngineStats()
    stats.work_arrived(0.0)
    stats.record(record(0.0, 2.0))
    b = stats.record(record(1.0, 3.5))  # dispatched while the first still ran: starts at 2.0
    assert (b.device_seconds, b.host_gap) == (1.5, 0.0)


def test_idle_time_without_work_is_not_the_hosts():
    stats = EngineStats()
    stats.work_arrived(0.0)
    stats.record(record(0.5, 1.0))
    stats.work_arrived(10.0)  # the engine had nothing to do from 1.0 until 10.0
    b = stats.record(record(10.25, 11.0))
    assert b.host_gap == 0.25


def test_unmeasured_steps_take_the_last_measured_time_of_their_shape():
    stats = EngineStats()
    stats.record(record(0.0, 0.01))  # measured: decode takes 10 ms
    later = stats.record(record(1.0, 1.05, exact=False))  # only known done by 1.05
    assert later.device_seconds == pytest.approx(0.01)
    other = stats.record(record(2.0, 2.5, exact=False, shape=PREFILL))  # no measurement of this shape yet
    assert other.device_seconds == pytest.approx(0.5)
    nxt = stats.record(record(2.52, 2.6))  # the estimate put the device free at 2.5: 20 ms idle
    assert nxt.host_gap == pytest.approx(0.02)


def test_sampling_waits_for_the_first_step_of_each_shape_then_one_in_the_interval():
    stats = EngineStats()
    stats.record(record(0.0, 0.01))
    assert stats.sample_due(PREFILL)
    due = [stats.sample_due(DECODE) for _ in range(3 * SAMPLE_INTERVAL)]
    assert sum(due) == 3


def test_step_clock_exact_end_only_when_the_host_blocked():
    clock = StepClock(1.0)
    clock.saw_ready(2.0)
    assert clock.fetched(3.0, 3.001, blocked=False) == pytest.approx(0.001)
    assert clock.ready_at == 2.0 and clock.end is None
    clock = StepClock(1.0)
    clock.fetched(3.0, 4.0, blocked=True)
    assert clock.ready_at == 4.0 and clock.end == 4.0


def test_attention_pairs_of_a_chunk():
    assert attention_work(10, 1) == 10  # a decode token attends to the whole context
    assert attention_work(4, 4) == 1 + 2 + 3 + 4  # causal prompt
    assert attention_work(10, 3, sliding_window=4) == 4 + 4 + 4


# ---- the cost model -------------------------------------------------------------------------------------------
def test_cost_of_a_decode_step_by_hand():
    kv_per_token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4
    cost = ModelCost.of(CFG, "float32", kv_per_token)
    embed_row = CFG.hidden_size * 4
    assert cost.step_weight_bytes == weight_bytes(CFG, "float32") - CFG.vocab_size * embed_row
    work = cost.work(steps=1, tokens=2, seqs=2, context_tokens=30, attended_pairs=30)
    assert work.weight_bytes == cost.step_weight_bytes + 2 * embed_row
    assert work.kv_read_bytes == 30 * kv_per_token and work.kv_write_bytes == 2 * kv_per_token
    layer = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128
    assert work.flops == 2 * 2 * layer * 2 + 2 * 2 * 1000 * 64 + 30 * 4 * 4 * 16 * 2
    tied = ModelCost.of(dataclasses.replace(CFG, tie_word_embeddings=True), "float32", kv_per_token)
    assert tied.token_weight_bytes == 0  # the table is read whole as the LM head


def test_costs_are_linear_so_totals_price_like_records():
    cost = ModelCost.of(CFG, "float32", 1024)
    stats = EngineStats()
    records = [record(i, i + 0.5, tokens=t, seqs=s, context_tokens=c, attended_pairs=p)
               for i, (t, s, c, p) in enumerate([(4, 4, 40, 40), (64, 2, 64, 1000), (1, 1, 9, 9)])]
    records.append(record(3, 3.5, tokens=14, seqs=2, context_tokens=300, attended_pairs=300, burst=8,
                          sampled_tokens=14))  # a decode burst: one row of 8 steps, one of 6
    for r in records:
        stats.record(r)
    assert cost.of_totals(stats.totals) == cost.of_records(records)
    assert stats.totals.steps == 4 and stats.totals.passes == 3 + 8 and stats.totals.head_rows == 4 + 2 + 1 + 14


def test_a_decode_burst_costs_its_steps():
    """A burst of D decode steps in one call reads the weights D times and runs the LM head once a sampled token;
    its device time is sampled apart from single steps of the same shape."""
    cost = ModelCost.of(CFG, "float32", 1024)
    burst = record(0, 1, tokens=8, seqs=1, context_tokens=100, attended_pairs=100, burst=8, sampled_tokens=8)
    single = record(0, 1, tokens=1, seqs=1, context_tokens=12, attended_pairs=12, sampled_tokens=1)
    assert cost.of_records([burst]).weight_bytes == 8 * cost.of_records([single]).weight_bytes
    assert cost.of_records([burst]).flops - 8 * cost.of_records([single]).flops == cost.flops_per_pair * (100 - 96)
    stats = EngineStats()
    stats.record(burst)
    assert stats.sample_due(DECODE, 1) and not stats.sample_due(DECODE, 8)


# ---- the verdict --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps, idle, capacity, compute, bandwidth, verdict", [
    (0, 0.0, 0.0, 0.0, 0.0, "idle"),
    (10, 0.6, 0.9, 0.9, 0.1, "host"),  # host first: the device waits whatever else is true
    (10, 0.4, 0.5, 0.9, 0.1, "capacity"),
    (10, 0.4, 0.4, 0.3, 0.2, "compute"),
    (10, 0.0, 0.0, 0.02, 0.05, "bandwidth"),  # at the latency threshold, the roofline decides
    (10, 0.0, 0.0, 0.03, 0.04, "latency"),  # near neither ceiling: fixed per-step costs
    (10, 0.4, 0.6, 0.01, 0.01, "capacity"),  # waiting for pages comes first
])
def test_classify_rules_in_order(steps, idle, capacity, compute, bandwidth, verdict):
    assert classify(steps, idle, capacity, compute, bandwidth) == verdict


def test_window_report_fractions():
    cost = ModelCost(step_weight_bytes=10**6, token_weight_bytes=0, kv_bytes_per_token=1000, matmul_params=10**5,
                     head_params=0, flops_per_pair=0)
    records = [record(0.0, 0.002, tokens=1, seqs=1), record(0.003, 0.005, tokens=1, seqs=1, page_stall=True)]
    stats = EngineStats()
    stats.work_arrived(0.0)
    records = [stats.record(r) for r in records]
    report = window_report(records, cost, CEILINGS)
    assert report.busy_seconds == pytest.approx(0.004) and report.idle_seconds == pytest.approx(0.001)
    assert report.idle_fraction == pytest.approx(0.2) and report.capacity_fraction == 0.5
    assert report.bandwidth_fraction == pytest.approx((2 * 10**6 + 2000) / 0.004 / 1e9)  # 2 steps, 1 token each
    assert report.compute_fraction == pytest.approx(2 * 2 * 10**5 / 0.004 / 1e10)
    assert report.verdict == "capacity"  # half the steps were planned with requests waiting for pages


def test_monitor_reads_only_the_window_of_every_replica():
    """Replicas' engine threads submit their step records (frozen) to one monitor; a read keeps the window."""
    monitor = BottleneckMonitor(ModelCost.of(CFG, "float32", 1024), CEILINGS, window_seconds=10.0)
    for i in range(2):
        stats = EngineStats()
        monitor.submit([stats.record(record(0.0, 1.0 + i)), stats.record(record(50.0, 51.0 + i))])
    assert sorted(r.done_at for r in monitor.recent_records(now=55.0)) == [51.0, 52.0]
    assert monitor.report(now=55.0).steps == 2 and monitor.report(now=100.0).verdict == "idle"


def test_monitor_counts_tokens_per_step_and_drains_an_unread_inbox():
    """iteration_tokens_total's buckets; an engine whose records nobody reads drains its inbox itself."""
    monitor = BottleneckMonitor(ModelCost.of(CFG, "float32", 1024), CEILINGS)
    monitor.MAX_PENDING = 2
    stats = EngineStats()
    for tokens in (1, 8, 9, 300, 20000):
        monitor.submit([stats.record(record(0.0, 1.0, tokens=tokens, seqs=1))])
        assert monitor._inbox.qsize() <= 2
    sizes = monitor.step_sizes()
    le = dict(zip(sizes.buckets, sizes.cumulative))
    assert (le[1], le[8], le[16], le[256], le[512], le[16384]) == (1, 2, 3, 3, 4, 4)
    assert sizes.count == 5 and sizes.sum == 1 + 8 + 9 + 300 + 20000


def test_rates_are_logged_with_an_si_prefix():
    assert si_rate(4.4e10, "FLOP/s") == "44 GFLOP/s"
    assert si_rate(1.52e10, "B/s") == "15.2 GB/s"
    assert si_rate(9.9e14, "FLOP/s") == "990 TFLOP/s"
    assert si_rate(512, "B/s") == "512 B/s"


# ---- device ceilings ----------------------------------------------------------------------------------------------
FAKE_H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")


def test_ceilings_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    calls = []

    def measure(device, dtype):
        calls.append(dtype)
        return DeviceCeilings(device.device_kind, dtype, 3e12, 8e14, "measured")

    monkeypatch.setattr(ceilings_module, "measure_ceilings", measure)
    first = device_ceilings(FAKE_H100, "bfloat16", tmp_path)
    again = device_ceilings(FAKE_H100, "bfloat16", tmp_path)
    assert first == again and calls == ["bfloat16"]
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())) == 1
    device_ceilings(FAKE_H100, "float32", tmp_path)  # another dtype is another entry
    assert calls == ["bfloat16", "float32"]


def test_a_failed_probe_falls_back_to_the_datasheet_on_a_known_gpu(monkeypatch):
    def oom(*args):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(ceilings_module, "measure_copy_bandwidth", oom)
    fallback = ceilings_module.measure_ceilings(FAKE_H100, "bfloat16")
    assert fallback.source == "datasheet" and fallback.bandwidth == 3.35e12
    with pytest.raises(RuntimeError):
        ceilings_module.measure_ceilings(types.SimpleNamespace(platform="gpu", device_kind="Mystery"), "bfloat16")


def test_the_cpu_probe_gives_plausible_ceilings():
    import jax
    measured = ceilings_module.measure_ceilings(jax.devices()[0], "float32")
    assert 1e8 < measured.bandwidth < 1e12 and 1e8 < measured.flops < 1e13


# ---- the scheduler says when requests wait for pages ------------------------------------------------------------
def test_plans_say_when_a_request_waits_for_kv_pages():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, page_size=4)
    sched = Scheduler(config, PageAllocator(9, 4, False))  # 8 usable pages: 32 tokens
    device = FakeDevice(9, 4, config.num_slots)
    sched.add_request("a", list(range(1, 21)), SamplingParams(temperature=0.0, max_tokens=8))  # 5 pages
    plan = sched.schedule()
    assert not plan.waiting_for_pages
    sched.update(plan, device.execute(plan))
    sched.add_request("b", list(range(1, 17)), SamplingParams(temperature=0.0, max_tokens=8))  # needs 4: 3 free
    plan = sched.schedule()
    assert plan.waiting_for_pages and [r.seq_id for r in plan.seqs] == [0]


def test_percentiles_nearest_rank():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    values = list(range(1, 101))
    assert percentiles(values) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([None, 3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}


def test_server_metrics_read_every_data_parallel_replica():
    """The router's stats snapshot (what /metrics reads) adds up its replicas' counts; KV usage is their mean."""
    from jaxserve.engine.messages import SchedulerStats
    from jaxserve.engine.replicas import ReplicaRouter
    snapshots = [SchedulerStats(num_running=1, num_waiting=2, kv_cache_usage=0.5, prefix_cache_hits=2,
                                totals=StepTotals(steps=3, tokens=10)),
                 SchedulerStats(num_running=2, kv_cache_usage=0.25, totals=StepTotals(steps=4, device_seconds=1.5))]
    router = ReplicaRouter([types.SimpleNamespace(info=None, stats=lambda s=s: s) for s in snapshots])
    assert router.stats() == SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.375, prefix_cache_hits=2,
                                            totals=StepTotals(steps=7, tokens=10, device_seconds=1.5))