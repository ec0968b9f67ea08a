"""bench/soak.py for 60 s against `jaxserve serve` (the tiny llama3.1 fixture): mixed traffic, disconnects, n > 1,
stop strings, logprobs, chat and bad requests give no unexpected error, the server's RSS does not grow, and the
KV cache is empty at the end. The 10-minute run's figures are in bench/RESULTS.md."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from test_server_harness import TINY_ENGINE_FLAGS

ROOT = Path(__file__).resolve().parents[1]


def test_a_60_second_soak_passes(converted, tmp_path):
    report_path = tmp_path / "soak.json"
    command = [sys.executable, str(ROOT / "bench" / "soak.py"), "--model", str(converted("llama3.1")),
               "--serve-args", shlex.join(TINY_ENGINE_FLAGS), "--duration", "60", "--concurrency", "4",
               "--max-tokens", "8", "--json", str(report_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    subprocess.run(command, check=True, env=env, cwd=tmp_path, timeout=900, capture_output=True)
    report = json.loads(report_path.read_text())
    assert report["unexpected_errors"] == 0, report["unexpected_examples"]
    assert report["requests"] > 100 and all(report["by_kind"].values()), report
    assert report["kv_cache_usage_end"] == 0.0
    assert report["rss_growth"] < 0.10, report
    # The verdict's 1.3x holds on a quiet machine (bench/RESULTS.md); this 2-core machine is shared, and 15 s
    # windows are short, so the suite only guards against a drift that noise cannot explain.
    assert report["p99_ratio"] < 2.0, report
