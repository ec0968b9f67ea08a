"""Multi-host on one machine: two `jaxserve generate` processes joined by jax.distributed on 127.0.0.1, each with 2
forced CPU devices, one model tensor-parallel over all 4 (every KV head on its own device, the cross-process
collectives through JAX's Gloo CPU collectives), give the tokens one process gives, and transformers gave."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from conftest import HF_FIXTURES
from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams

NEW_TOKENS = 8
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=16, max_model_len=128, decode_buckets=(4,),
              prefill_token_buckets=(32,), prefill_seq_buckets=(4,), context_buckets=(128,),
              kv_cache_memory=2**22, xla_optimization_level=0, compilation_cache_dir="")


def flags(options: dict) -> list[str]:
    out = []
    for name, value in options.items():
        value = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        out += [f"--{name.replace('_', '-')}", value]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_on_two_processes(model_dir, prompts: list[str], logs, timeout: float = 300) -> list[tuple[int, str, str]]:
    """`jaxserve generate` as processes 0 and 1 of a two-process run; (returncode, stdout, stderr) of each. Output
    goes to files in `logs`: a pipe left unread could fill up and stall one process inside a collective."""
    options = {**ENGINE, "tensor_parallel_size": 4, "coordinator_address": f"127.0.0.1:{free_port()}",
               "num_processes": 2}
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "TQDM_DISABLE": "1"}
    command = [sys.executable, "-m", "jaxserve.cli", "generate", "--model", str(model_dir), "--json",
               "--temperature", "0", "--max-tokens", str(NEW_TOKENS), "--ignore-eos", *flags(options)]
    for prompt in prompts:
        command += ["--prompt", prompt]
    files = {pid: (logs / f"p{pid}.out", logs / f"p{pid}.err") for pid in (0, 1)}
    procs = {}
    try:
        for pid in (1, 0):
            out, err = files[pid]
            with open(out, "w") as stdout, open(err, "w") as stderr:
                procs[pid] = subprocess.Popen(command + ["--process-id", str(pid)], stdout=stdout, stderr=stderr,
                                              env=env)
        for pid in (0, 1):
            procs[pid].wait(timeout=timeout)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(procs[pid].returncode, files[pid][0].read_text(), files[pid][1].read_text()) for pid in (0, 1)]


def test_two_processes_generate_what_one_process_does(converted, tmp_path):
    model_dir = converted("llama2")  # 4 heads, 4 KV heads: tensor-parallel 4 splits every one of them
    reference = json.loads((HF_FIXTURES / "llama2" / "reference.json").read_text())["prompts"]
    reference = [p for p in reference if p["text"]]
    prompts = [p["text"] for p in reference]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    one_process = [o.outputs[0].token_ids for o in LLM(str(model_dir), show_progress=False,
                                                        **ENGINE).generate(prompts, params)]
    (leader_rc, leader_out, leader_err), (follower_rc, follower_out, follower_err) = generate_on_two_processes(
        model_dir, prompts, tmp_path)
    assert leader_rc == 0, leader_err[-3000:]
    assert follower_rc == 0, follower_err[-3000:]
    results = [json.loads(line) for line in leader_out.splitlines() if line.startswith("{")]  # Gloo prints too
    assert not [line for line in follower_out.splitlines() if line.startswith("{")]  # a follower prints no results
    steps = int(follower_err.split("ran the leader's ")[1].split()[0])
    assert steps >= NEW_TOKENS  # the prompts' prefill chunks, then a decode step per further token
    two_processes = [result["outputs"][0]["token_ids"] for result in results]
    assert two_processes == one_process
    assert one_process == [p["continuation"][:NEW_TOKENS] for p in reference]
