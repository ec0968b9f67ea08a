"""bench/quant_accuracy.py and bench/quant_speed.py --smoke: the benchmarks' code paths on tiny models and shapes."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def accuracy():
    yield _load("quant_accuracy")
    del sys.modules["bench_quant_accuracy"]


@pytest.fixture(scope="module")
def speed():
    yield _load("quant_speed")
    del sys.modules["bench_quant_speed"]


def test_accuracy_report_on_a_fixture_and_any_text(accuracy, converted, tmp_path, capsys):
    out, markdown = tmp_path / "acc.json", tmp_path / "acc.md"
    rc = accuracy.main(["--model", str(converted("llama2")), "--text", str(BENCH.parent / "jaxserve" / "quant"),
                        "--seq-len", "32", "--max-windows", "6", "--batch", "4", "--schemes", "int8", "int4",
                        "kv-int8", "kv-fp8", "int8+kv-int8", "--out", str(out), "--markdown", str(markdown)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["scheme"]: r for r in result["schemes"]}
    assert set(rows) == {"int8", "int4", "kv-int8", "kv-fp8", "int8+kv-int8"} and result["windows"] == 6
    base = rows["int8"]["base_ppl"]
    for r in rows.values():
        assert r["tokens"] == 6 * 32 and r["base_ppl"] == pytest.approx(base, rel=1e-6)
        assert r["kl"] >= 0 and 0 < r["top1_agree"] <= 1
        assert r["ppl_change_pct"] == pytest.approx(100 * (r["ppl"] / base - 1), abs=1e-6)
    assert rows["int8"]["kl"] < rows["int4"]["kl"]  # more bits, closer to the float model
    assert rows["kv-int8"]["kv_bytes_per_token"] < result["base"]["kv_bytes_per_token"]
    assert rows["int4"]["weight_bytes"] < rows["int8"]["weight_bytes"] < result["base"]["weight_bytes"]
    assert "| int8 |" in markdown.read_text() and "int4" in capsys.readouterr().out
    assert not math.isnan(rows["int4"]["ppl"])


def test_accuracy_refuses_a_quantized_model(accuracy, tmp_path):
    from jaxserve.convert import convert
    quantized = convert(BENCH.parent / "tests" / "fixtures" / "qwen2" / "hf", tmp_path / "q", quantize="int8",
                        progress=False)
    with pytest.raises(SystemExit, match="already quantized"):
        accuracy.main(["--model", str(quantized), "--text", str(BENCH / "quant_accuracy.py")])


def test_speed_smoke_times_every_matmul_and_summarizes(speed, tmp_path, capsys):
    out = tmp_path / "speed.json"
    results = speed.main(["--smoke", "--only", "matmul", "--out", str(out)])
    impls = {r["impl"] for r in results["rows"]}
    assert impls == {"bf16_dot", "w8a16_pallas", "w4a16_pallas", "w8a16_xla", "w4a16_xla"}
    assert all(r["us"] > 0 and r["speedup_vs_bf16"] > 0 for r in results["rows"])
    markdown = tmp_path / "q.md"
    merged = speed.main(["--summarize", str(out), str(tmp_path / "absent.json"), "--markdown", str(markdown)])
    assert merged["rows"] == json.loads(out.read_text())["rows"]
    assert "W8A16 at M <= 16" in markdown.read_text()
    assert "bf16 dot us" in capsys.readouterr().out


def test_speed_smoke_times_the_imported_formats(speed):
    rows = ("w4a16_zp", "w4a16_zp_act", "w8a16_zp", "wfp8a16", "wfp8a16_g128")
    results = speed.main(["--smoke", "--only", "matmul", "--rows", *rows])
    impls = {r["impl"] for r in results["rows"]}
    assert impls == {"bf16_dot"} | {f"{row}_{path}" for row in rows for path in ("pallas", "xla")}
    assert all(r["us"] > 0 for r in results["rows"])
    summary = "\n".join(speed.summarize(results))
    assert "imported formats" in summary and "| w4a16_zp_act_pallas | int4-g128-zp-act |" in summary
