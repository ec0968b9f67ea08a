"""The bundled demo model as a newcomer meets it: `jaxserve serve` with no arguments, from the repository root,
answers a streaming completion with text that reads like its corpus (Python source)."""

from __future__ import annotations

import json
import keyword
import os
import subprocess
import sys
from pathlib import Path

import httpx

from test_server_lifecycle import free_port, responds, wait_for

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "checkpoints" / "demo"


def python_likeness(text: str) -> dict:
    words = text.replace("(", " ").replace(")", " ").replace(":", " ").replace(".", " ").split()
    return dict(keywords=sum(keyword.iskeyword(w) for w in words), ascii=sum(c.isascii() for c in text) / len(text),
                lines=text.count("\n"), calls=text.count("("))


def test_demo_checkpoint_is_bundled_and_small():
    assert (DEMO / "jaxserve.json").exists(), "checkpoints/demo must ship with the repository"
    size = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert size < 60 * 2**20, f"checkpoints/demo is {size / 2**20:.1f} MiB"
    summary = json.loads((DEMO / "training_summary.json").read_text())
    assert summary["heldout"]["perplexity"] < 30


def test_serve_without_arguments_streams_python(tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w+") as log:
        process = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port)], cwd=ROOT,
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: process.poll() is not None or responds(url), 300, "the demo server to start")
            assert process.poll() is None, log_path.read_text()
            # Four samples judged together: one draw at temperature 0.8 from a 3M-parameter model is a coin toss
            # (one in four stops after a docstring and a return), four are not.
            request = {"model": "checkpoints/demo", "prompt": "def read_config(path):\n", "max_tokens": 96,
                       "temperature": 0.8, "seed": 0, "n": 4, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=120) as response:
                assert response.status_code == 200
                events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        finally:
            process.terminate()
            process.wait(60)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(4)]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0].get("finish_reason")]
    assert len(finishes) == 4 and set(finishes) <= {"length", "stop"}, finishes
    likeness = python_likeness("".join(texts))
    # Python source: keywords, calls, several lines, ASCII. A random or broken model gives none of these.
    assert likeness["keywords"] >= 8 and likeness["calls"] >= 4 and likeness["lines"] >= 8, (texts, likeness)
    assert likeness["ascii"] > 0.97, texts
