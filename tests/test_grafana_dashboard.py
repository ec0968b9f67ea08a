"""docs/grafana-jaxserve.json against a live server under load, through a real Prometheus: Debian's package
(`apt-get install prometheus`, 2.42; make test installs it) scrapes the test server every second with
docs/prometheus.yml (its target and interval rewritten) while clients send traffic; then every query of every
panel of the shipped dashboard, its model_name variable, and every query of vLLM's own Grafana dashboard with
vllm: relabelled to jaxserve: must return data. Skipped, saying so, where no Prometheus binary is installed."""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.engine.engine import LLMEngine
from test_server_harness import TINY_ENGINE, running_engine, serve_in_thread, server_state

DOCS = Path(__file__).resolve().parents[1] / "docs"
PROMETHEUS = shutil.which("prometheus")
MODEL = "tiny-llama"
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval for a 1 s scrape interval is at least 4 s
LOAD_SECONDS = 12.0

NO_PROMETHEUS = ("no prometheus binary: install Debian's package (apt-get install prometheus, as make test does) "
                 "to evaluate the dashboard's queries")

# The queries of vLLM's Grafana dashboard (examples/observability/prometheus_grafana), vllm: -> jaxserve:.
VLLM_DASHBOARD = [
    *(f"histogram_quantile({q}, sum by(le) (rate(jaxserve:{h}_bucket{{model_name=\"$model_name\"}}"
      f"[$__rate_interval])))" for q in (0.99, 0.95, 0.9, 0.5)
      for h in ("e2e_request_latency_seconds", "inter_token_latency_seconds", "time_to_first_token_seconds")),
    *(f"rate(jaxserve:{h}_sum{{model_name=\"$model_name\"}}[$__rate_interval]) / "
      f"rate(jaxserve:{h}_count{{model_name=\"$model_name\"}}[$__rate_interval])"
      for h in ("e2e_request_latency_seconds", "inter_token_latency_seconds", "time_to_first_token_seconds")),
    *(f"rate(jaxserve:{c}{{model_name=\"$model_name\"}}[$__rate_interval])"
      for c in ("prompt_tokens_total", "generation_tokens_total", "request_queue_time_seconds_sum",
                "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
                "request_max_num_generation_tokens_sum")),
    *(f"jaxserve:{g}{{model_name=\"$model_name\"}}"
      for g in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                "gpu_cache_usage_perc")),
    *(f"sum by(le) (increase(jaxserve:{h}_bucket{{model_name=\"$model_name\"}}[$__rate_interval]))"
      for h in ("request_prompt_tokens", "request_generation_tokens")),
    "sum by(finished_reason) (increase(jaxserve:request_success_total{model_name=\"$model_name\"}"
    "[$__rate_interval]))",
    # what autoscalers and older dashboards read
    "histogram_quantile(0.9, sum by(le) (rate(jaxserve:iteration_tokens_total_bucket[$__rate_interval])))",
    "jaxserve:cache_config_info",
]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every target of every panel of the shipped dashboard."""
    dashboard = json.loads((DOCS / "grafana-jaxserve.json").read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", ())]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def prometheus(tmp_path: Path, target: str):
    """Prometheus on 127.0.0.1 scraping `target` every second, with docs/prometheus.yml's scrape job."""
    config = (DOCS / "prometheus.yml").read_text()
    assert '"127.0.0.1:8000"' in config and "scrape_interval: 5s" in config
    config = config.replace('"127.0.0.1:8000"', f'"{target}"').replace("interval: 5s", "interval: 1s")
    (tmp_path / "prometheus.yml").write_text(config)
    port = free_port()
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert process.poll() is None, "prometheus exited at start-up"
            assert time.monotonic() < deadline, "prometheus was not ready within 60 s"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def traffic(server_url: str, stop: threading.Event):
    """Two clients in a loop until `stop`: completions with n = 2, streamed completions, chat."""
    bodies = [("/v1/completions", {"model": MODEL, "prompt": "The river ran past the mill", "max_tokens": 6,
                                   "n": 2, "temperature": 0.8, "seed": 1}),
              ("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "stream": True}),
              ("/v1/chat/completions", {"model": MODEL, "max_tokens": 5,
                                        "messages": [{"role": "user", "content": "Hello there"}]})]

    def client(offset: int) -> None:
        with httpx.Client(base_url=server_url, timeout=60) as http:
            i = offset
            while not stop.is_set():
                path, body = bodies[i % len(bodies)]
                http.post(path, json=body).raise_for_status()
                i += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def instant(prometheus_url: str, expr: str) -> list[dict]:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model_name", MODEL)
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=30)
    assert response.status_code == 200, (expr, response.text)
    return response.json()["data"]["result"]


@pytest.fixture(scope="module")
def scraped(converted, tmp_path_factory):
    """A Prometheus URL whose store holds LOAD_SECONDS of the server's metrics under load (the load goes on
    while the module's queries run)."""
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS)
    model_dir = converted("llama3.1")
    engine = LLMEngine.from_model_dir(model_dir, TINY_ENGINE, show_progress=False)
    stop = threading.Event()
    with (running_engine(engine) as async_engine,
          serve_in_thread(server_state(async_engine, model_dir)) as live,
          prometheus(tmp_path_factory.mktemp("prometheus"), live.url.removeprefix("http://")) as url,
          traffic(live.url, stop)):
        time.sleep(LOAD_SECONDS)
        up = instant(url, 'up{job="jaxserve"}')
        assert up and up[0]["value"][1] == "1", f"prometheus could not scrape the server: {up}"
        yield url


def test_the_dashboard_reads_only_documented_series():
    """Without Prometheus too: every series a query names is one docs/metrics.md documents (and the server
    exports: tests/test_metrics_server.py holds the two lists equal)."""
    documented = set(re.findall(r"`(jaxserve:[a-z0-9_:]+)`", (DOCS / "metrics.md").read_text()))
    for title, expr in dashboard_queries():
        for name in re.findall(r"jaxserve:[a-z0-9_:]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in documented or base in documented, f"panel {title!r} reads {name}, not a jaxserve series"


def test_the_model_variable_lists_the_served_model(scraped):
    dashboard = json.loads((DOCS / "grafana-jaxserve.json").read_text())
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "model_name")
    assert variable["definition"] == "label_values(jaxserve:engine_alive, model_name)"
    response = httpx.get(f"{scraped}/api/v1/label/model_name/values",
                         params={"match[]": "jaxserve:engine_alive"}, timeout=30)
    assert response.json()["data"] == [MODEL]


@pytest.mark.parametrize("title, expr", dashboard_queries(), ids=[f"{t}: {e[:40]}" for t, e in dashboard_queries()])
def test_every_panel_query_of_the_shipped_dashboard_returns_data(scraped, title, expr):
    result = instant(scraped, expr)
    assert result, f"panel {title!r}: no data for {expr}"
    values = [float(series["value"][1]) for series in result]
    assert any(math.isfinite(v) for v in values), f"panel {title!r}: only {values} for {expr}"


@pytest.mark.parametrize("expr", VLLM_DASHBOARD)
def test_vllms_dashboard_relabelled_has_no_empty_panel(scraped, expr):
    assert instant(scraped, expr), f"no data for {expr}"
