"""The CPU backend's host allocator settings (jaxserve/host_memory.py): a step's temporary buffers stay resident."""

import json
import os
import subprocess
import sys

import pytest

from jaxserve import host_memory

PROBE = """
import json, resource
import jaxserve, jax, jax.numpy as jnp
from jaxserve import host_memory

@jax.jit
def step(x):  # three [256, 32000] float32 temporaries (32 MB each), like a decode step's logits and their copies
    y = jnp.sin(x)
    z = jnp.cos(y) * 2
    return (y[::-1] + z).sum(axis=1)

x = jnp.ones((256, 32000), jnp.float32)
host_memory.release()
for _ in range(20):  # the heap settles after a few calls (here 4-10)
    step(x).block_until_ready()
windows = []
for _ in range(3):  # the best of three windows: one full test run saw a window still faulting (see the note)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step(x).block_until_ready()
    windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
print(json.dumps({"tuned": host_memory._libc is not None, "faults_per_call": min(windows), "windows": windows}))
"""


def probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_step_temporaries_stay_resident():
    tuned, default = probe(), probe(JAXSERVE_HOST_MALLOC="default")
    assert tuned["tuned"] and not default["tuned"]
    assert default["faults_per_call"] > 5000  # glibc's defaults fault the 64+ MB of temporaries in at every call
    assert tuned["faults_per_call"] < 100, tuned


def test_only_for_a_cpu_only_process(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_memory.cpu_only()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.cpu_only()
