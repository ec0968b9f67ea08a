"""lm-evaluation-harness (the test extra installs it) against a live server, as the README shows it: the
`local-completions` model in its auto tokenizer mode finds /tokenizer_info and uses the server's tokenizer, so no
tokenizer path is passed; a tiny local multiple-choice task (loglikelihoods) and a generate_until task run to the
end, and lm-eval's scores are the ones the server's own echo + logprobs give."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from test_server_harness import TINY_ENGINE, live_server

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[test]' brings it)")

MODEL = "tiny-llama"
MC_DOCS = [{"question": "The river ran past the", "choices": ["mill", "moon", "idea"], "answer": 0},
           {"question": "Once upon a", "choices": ["time", "table"], "answer": 0},
           {"question": "One, two,", "choices": ["three", "blue", "seven"], "answer": 0}]
GEN_DOCS = [{"prompt": "Hello, my name is", "target": " Bob"}, {"prompt": "The capital of France is",
                                                                   "target": " Paris"}]


def write_tasks(directory: Path) -> None:
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\n"
    (directory / "jaxserve_tiny_mc.yaml").write_text(
        f"task: jaxserve_tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (directory / "jaxserve_tiny_gen.yaml").write_text(
        f"task: jaxserve_tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def server(converted):
    with live_server(converted("llama3.1"), TINY_ENGINE) as live:
        yield live


def run_lm_eval(server, tmp_path: Path) -> tuple[dict, list[dict], str]:
    write_tasks(tmp_path)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"base_url={server.url}/v1/completions,model={MODEL},num_concurrent=1,max_retries=1",
               "--tasks", "jaxserve_tiny_mc,jaxserve_tiny_gen", "--include_path", str(tmp_path),
               "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for path in out.rglob("samples_jaxserve_tiny_mc_*.jsonl")
               for line in path.read_text().splitlines()]
    return results, samples, log


@pytest.mark.slow  # ~90 s on a loaded 2-core CPU, most of it lm-eval's own imports: make test-slow runs it
def test_lm_eval_local_completions_uses_the_servers_tokenizer(server, tmp_path):
    results, samples, log = run_lm_eval(server, tmp_path)
    assert "remote tokenizer" in log.lower(), log[-4000:]  # auto mode found /tokenizer_info and /tokenize
    assert 0.0 <= results["results"]["jaxserve_tiny_mc"]["acc,none"] <= 1.0
    assert "exact_match,none" in results["results"]["jaxserve_tiny_gen"]
    assert len(samples) == len(MC_DOCS)
    # each choice's loglikelihood is what the server's echo + logprobs give for the continuation's tokens
    # (lm-eval puts its target_delimiter, a space, between the question and each choice)
    doc = next(s for s in samples if s["doc"]["question"] == MC_DOCS[0]["question"])
    for choice, response in zip(MC_DOCS[0]["choices"], doc["filtered_resps"]):
        expected = continuation_logprob(server, MC_DOCS[0]["question"], " " + choice)
        assert math.isclose(float(response[0]), expected, rel_tol=1e-4, abs_tol=1e-4), (choice, response)


def continuation_logprob(server, context: str, continuation: str) -> float:
    """Sum of the continuation tokens' logprobs, scored by the server as lm-eval scores them."""
    def tokens(text: str) -> list[int]:
        return httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    context_ids, whole = tokens(context), tokens(context + continuation)
    assert whole[:len(context_ids)] == context_ids
    body = {"model": MODEL, "prompt": whole, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    logprobs = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["logprobs"]
    return sum(logprobs["token_logprobs"][len(context_ids):len(whole)])
