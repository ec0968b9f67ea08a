"""/metrics of a live server: every documented name is exported (vLLM's names with the jaxserve: prefix), request
histograms and engine counters move with traffic, the bottleneck gauges name exactly one verdict, and
docs/metrics.md lists every metric the server exports."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.observability.bottleneck import VERDICTS
from test_server_harness import TINY_ENGINE, live_server

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
MODEL = {"model_name": "tiny-llama"}
# vLLM's name (without vllm:) -> ours (without jaxserve:), where one exists
VLLM_NAMES = ["time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "request_params_n", "request_max_num_generation_tokens",
              "iteration_tokens_total", "cache_config_info", "gpu_cache_usage_perc", "num_requests_swapped",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds", "prompt_tokens_total",
              "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
              "prefix_cache_hits_total", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "request_success_total", "request_prompt_tokens", "request_generation_tokens"]


@pytest.fixture(scope="module")
def server(converted):
    # one token a step (no decode bursts), so that the counts below are per token
    with live_server(converted("llama3.1"), TINY_ENGINE.replace(decode_burst=1)) as live:
        yield live


def scrape(server) -> dict[str, dict[tuple, float]]:
    """sample name -> {sorted labels: value}."""
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get(name, {}).get(tuple(sorted({**MODEL, **labels}.items())), 0.0)


def complete(server, prompt: str, max_tokens: int = 6) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    response.raise_for_status()
    return response.json()


def test_vllm_names_are_exported_with_the_jaxserve_prefix(server):
    complete(server, "The river ran")
    samples = scrape(server)
    for name in VLLM_NAMES:
        base = f"jaxserve:{name}"
        assert any(s == base or s.startswith(base + "_") for s in samples), base


def test_request_histograms_and_engine_counters_move_with_traffic(server):
    prompt = "A prompt long enough to fill a page or two of the cache " * 2
    complete(server, prompt)  # once, so the second one finds its pages in the prefix cache
    before = scrape(server)
    complete(server, prompt, max_tokens=7)
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    for histogram in ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_inference_time_seconds",
                      "request_time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"jaxserve:{histogram}_count") == 1, histogram
    assert delta("jaxserve:inter_token_latency_seconds_count") == 6  # 7 tokens, 6 gaps
    assert delta("jaxserve:time_per_output_token_seconds_count") == 6  # vLLM's older name of the same
    assert delta("jaxserve:iteration_tokens_total_count") == delta("jaxserve:engine_steps_total")
    assert delta("jaxserve:prefix_cache_hits_total") > 0
    assert delta("jaxserve:prefix_cache_queries_total") >= delta("jaxserve:prefix_cache_hits_total")
    assert delta("jaxserve:engine_steps_total") >= 7
    assert delta("jaxserve:device_busy_seconds_total") > 0
    assert delta("jaxserve:step_flops_total") > 0
    assert delta("jaxserve:step_bytes_total", kind="weights") > 0
    assert delta("jaxserve:step_bytes_total", kind="kv_write") > 0


def test_one_request_with_n_4_counts_as_vllm_counts_its_four_child_requests(server):
    """docs/metrics.md, "n > 1": every per-request series counts samples (vLLM runs each as a child request);
    request_params_n and request_max_num_generation_tokens once per request."""
    before = scrape(server)
    response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": "The river ran", "max_tokens": 5, "n": 4, "ignore_eos": True, "temperature": 1.0, "seed": 7})
    response.raise_for_status()
    prompt_len = response.json()["usage"]["prompt_tokens"]
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("jaxserve:request_success_total", finished_reason="length") == 4
    assert delta("jaxserve:prompt_tokens_total") == 4 * prompt_len
    assert delta("jaxserve:generation_tokens_total") == 20
    assert delta("jaxserve:request_prompt_tokens_count") == 4
    assert delta("jaxserve:request_prompt_tokens_sum") == 4 * prompt_len
    assert delta("jaxserve:request_generation_tokens_count") == 4
    assert delta("jaxserve:request_generation_tokens_sum") == 20
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds",
                      "request_inference_time_seconds", "request_time_per_output_token_seconds"):
        assert delta(f"jaxserve:{histogram}_count") == 4, histogram
    assert delta("jaxserve:inter_token_latency_seconds_count") == 16  # 4 samples x 4 gaps
    assert delta("jaxserve:time_per_output_token_seconds_count") == 16
    assert delta("jaxserve:request_params_n_count") == 1 and delta("jaxserve:request_params_n_sum") == 4
    assert delta("jaxserve:request_max_num_generation_tokens_count") == 1
    assert delta("jaxserve:request_max_num_generation_tokens_sum") == 5


def test_http_requests_carry_the_model_name(server):
    complete(server, "Hello")
    samples = scrape(server)
    assert value(samples, "jaxserve:http_requests_total", method="POST", route="/v1/completions",
                 status="200") >= 1


def test_vllm_compatibility_series(server):
    """What vLLM-keyed dashboards and autoscalers read besides the request series."""
    samples = scrape(server)
    assert value(samples, "jaxserve:gpu_cache_usage_perc") == value(samples, "jaxserve:kv_cache_usage_perc")
    assert value(samples, "jaxserve:num_requests_swapped") == 0
    (labels, info), = samples["jaxserve:cache_config_info"].items()
    labels = dict(labels)
    assert info == 1 and labels["block_size"] == str(TINY_ENGINE.page_size)
    assert int(labels["num_gpu_blocks"]) > 0 and labels["enable_prefix_caching"] == "True"
    for reason in ("stop", "length", "abort"):  # present before any request ends that way
        assert (("finished_reason", reason), ("model_name", "tiny-llama")) in samples["jaxserve:request_success_total"]
    for reason in ("queue_full", "draining", "engine_dead"):
        assert (("model_name", "tiny-llama"), ("reason", reason)) in samples["jaxserve:requests_rejected_total"]


def test_bottleneck_gauges_name_one_verdict(server):
    complete(server, "Hello")
    samples = scrape(server)
    flags = {verdict: value(samples, "jaxserve:bottleneck", verdict=verdict) for verdict in VERDICTS}
    assert sorted(flags.values()) == [0] * (len(VERDICTS) - 1) + [1], flags
    for name in ("bandwidth_fraction", "compute_fraction", "idle_fraction", "capacity_fraction"):
        assert value(samples, f"jaxserve:bottleneck_{name}") >= 0.0
    assert value(samples, "jaxserve:bottleneck_window_seconds") > 0
    assert value(samples, "jaxserve:device_bandwidth_ceiling_bytes_per_second") > 0
    assert value(samples, "jaxserve:device_flops_ceiling_per_second") > 0


def test_docs_list_every_exported_metric(server):
    complete(server, "Hello")
    documented = set(re.findall(r"`(jaxserve:[a-z0-9_:]+)`", DOCS.read_text()))
    exported = set()
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        if not family.name.endswith("_created"):  # prometheus_client's creation timestamps
            exported.add(family.name + ("_total" if family.type == "counter" else ""))
    assert exported <= documented, sorted(exported - documented)
    assert documented <= exported, sorted(documented - exported)
