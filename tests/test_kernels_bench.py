"""bench/kernels.py --smoke: the GPU benchmark's code paths, on tiny shapes in interpret mode."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_smoke_run_times_every_implementation(bench, tmp_path, capsys):
    out = tmp_path / "kernels.json"
    results = bench.main(["--smoke", "--sweep", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["copy_bandwidth_GBps"] > 0
    decode_impls = {r["impl"] for r in results["decode"]}
    assert decode_impls == {"pallas", "jax_example", "xla", "reference"}
    assert {r["impl"] for r in results["ragged"]} == {"pallas", "xla", "reference"}
    for row in results["decode"] + results["ragged"]:
        assert "skipped" not in row, row
        assert row["ms"] > 0 and 0 < row["frac_copy_bw"] and row["max_abs_err_vs_xla"] < 1e-4, row
    assert all("ms" in row for row in results["sweep"]), results["sweep"]
    assert "decode (ms per call" in capsys.readouterr().out

    markdown = tmp_path / "RESULTS.md"
    lines = bench.main(["--summarize", str(out), "--e2e", str(tmp_path / "absent.json"),
                        "--markdown", str(markdown)])["summary"]
    assert any(line.startswith("| 3 | 40 |") for line in lines)
    assert any("e2e: no result" in line for line in lines)
    assert markdown.read_text().startswith("# Kernel and end-to-end results")


def test_example_block_sizes_meet_its_divisibility_rules(bench):
    for pages in (2, 3, 5, 32, 128, 512):
        blocks = bench.example_blocks(pages)
        per_split = pages // blocks["k_splits"]
        assert pages % blocks["k_splits"] == 0 and per_split % blocks["pages_per_compute_block"] == 0


def test_ragged_flops_count_causal_pairs(bench):
    setup = bench.SMOKE
    # one sequence, 2 new tokens after 3 cached: they see 4 and 5 keys
    assert bench.ragged_flops([2], [5], setup) == 4.0 * setup.head_dim * setup.heads * 9
