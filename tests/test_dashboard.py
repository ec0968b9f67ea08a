"""/dashboard: the page, its data endpoint, and a browser test: Playwright driving Debian's headless Chromium
(both installed by `make test`) against a live server under load sees the plots update and saves a screenshot
to test-artifacts/dashboard.png.

The browser test fails, naming the fix, when Chromium or Playwright is missing; JAXSERVE_SKIP_BROWSER=1 skips it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.observability.bottleneck import VERDICTS
from test_server_harness import SMALL_ENGINE, live_server

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHARTS = ("throughput", "ttft", "tpot", "kv", "queue", "fractions")


@pytest.fixture(scope="module")
def live(converted):
    with live_server(converted("llama3.1"), SMALL_ENGINE) as live:
        yield live


@contextlib.contextmanager
def load(url: str, clients: int = 4):
    """Clients sending completions back to back (with some prompt lengths, stream or not) until the block ends."""
    stop = threading.Event()
    sent = [0] * clients

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while not stop.is_set():
                body = {"prompt": f"Client {i} request {sent[i]} " * (1 + sent[i] % 5), "max_tokens": 8 + 8 * (i % 3),
                        "temperature": 0.8, "ignore_eos": True, "stream": bool(i % 2)}
                http.post("/v1/completions", json=body).raise_for_status()
                sent[i] += 1

    threads = [threading.Thread(target=client, args=(i,), name=f"load-{i}", daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield sent
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def test_dashboard_data_has_what_the_page_plots(live):
    with load(live.url, clients=2):
        deadline = time.monotonic() + 60
        while (data := httpx.get(f"{live.url}/dashboard/data").json())["finished_requests"] < 2:
            assert time.monotonic() < deadline, "no request finished"
            time.sleep(0.2)
    assert data["totals"]["tokens"] > 0 and data["totals"]["generated_tokens"] > 0
    assert data["ttft"]["p50"] > 0 and data["ttft"]["p50"] <= data["ttft"]["p99"]
    assert data["tpot"]["p50"] > 0 and 0.0 <= data["kv_cache_usage"] <= 1.0
    bottleneck = data["bottleneck"]
    assert bottleneck["verdict"] in VERDICTS and bottleneck["steps"] > 0
    for key in ("bandwidth_fraction", "compute_fraction", "idle_fraction", "capacity_fraction"):
        assert bottleneck[key] >= 0.0
    assert data["ceilings"]["source"] == "measured" and data["ceilings"]["bandwidth"] > 0


def test_dashboard_page_is_self_contained(live):
    response = httpx.get(f"{live.url}/dashboard")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    assert "<script>" in html and "<style>" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page loads nothing from elsewhere"
    assert not re.search(r"@import|url\(\s*['\"]?https?:", html)
    assert "dashboard/data" in html and "<canvas" in html


def launch_chromium(playwright):
    """Debian's Chromium (playwright's own browser downloads cannot work here, and CI installs Debian's)."""
    executable = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(executable).exists():
        pytest.fail("Debian's chromium is not installed: run `make test` (it installs it) or "
                    "`apt-get install -y chromium`; JAXSERVE_SKIP_BROWSER=1 skips this test")
    return playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)


def canvas_state(page) -> dict[str, tuple[int, str]]:
    """Per chart: how many points it has drawn, and a hash of its pixels."""
    return page.evaluate("""ids => Object.fromEntries(ids.map(id => {
        const c = document.getElementById('chart-' + id);
        const data = c.toDataURL();
        let h = 0;
        for (let i = 0; i < data.length; i++) h = (h * 31 + data.charCodeAt(i)) | 0;
        return [id, [Number(c.dataset.points), String(h)]];
    }))""", list(CHARTS))


def test_dashboard_plots_update_in_headless_chromium_under_load(live):
    if os.environ.get("JAXSERVE_SKIP_BROWSER") == "1":
        pytest.skip("JAXSERVE_SKIP_BROWSER=1: the browser test is skipped on request")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: run `make test` (it installs it) or `pip install playwright`; "
                    "JAXSERVE_SKIP_BROWSER=1 skips this test")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright, load(live.url) as sent:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{live.url}/dashboard")
            page.wait_for_function("Number(document.getElementById('chart-throughput').dataset.points) >= 2",
                                   timeout=30_000)
            before = canvas_state(page)
            page.wait_for_function(
                f"Number(document.getElementById('chart-throughput').dataset.points) >= "
                f"{before['throughput'][0] + 3}", timeout=30_000)
            page.wait_for_function("document.getElementById('now-ttft').textContent.match(/[0-9]/)",
                                   timeout=30_000)
            after = canvas_state(page)
            verdict = page.get_attribute("#verdict", "data-verdict")
            throughput = page.evaluate("JSON.parse(document.getElementById('chart-throughput').dataset.last)")
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    assert sum(sent) > 0
    for chart in CHARTS:
        assert after[chart][0] > before[chart][0], f"{chart} drew no new points"
    changed = [chart for chart in CHARTS if after[chart][1] != before[chart][1]]
    assert {"throughput", "queue", "fractions"} <= set(changed), changed
    assert throughput[0] > 0, "the page shows no throughput under load"
    assert verdict in VERDICTS
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
