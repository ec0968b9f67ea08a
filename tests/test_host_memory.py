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
for _ in range(20):  # compile; the first calls grow the heap
    step(x).block_until_ready()
per_call = []
for _ in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(x).block_until_ready()
    per_call.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tuned": host_memory._libc is not None, "median": sorted(per_call)[len(per_call) // 2],
                  "per_call": per_call}))
"""


def probe(script: str = PROBE, **env) -> dict:
    """Runs `script` in a fresh CPU-only process (the allocator is set up at import) and returns its last line."""
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_step_temporaries_stay_resident():
    """glibc's defaults fault the 64+ MB of temporaries in at every call; tuned, most calls fault nothing. Not every
    call: while the single arena is fragmented, a call whose 64 MB block fits no free chunk grows the heap and faults
    the new pages in once (one call in ten at calls 20-50 on a loaded 2-vCPU VM; see jaxserve/host_memory.py)."""
    tuned, default = probe(), probe(JAXSERVE_HOST_MALLOC="default")
    assert tuned["tuned"] and not default["tuned"]
    assert default["median"] > 5000, default
    assert tuned["median"] < 100, tuned


def test_only_for_a_cpu_only_process(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_memory.cpu_only()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.cpu_only()


HUGE_PROBE = """
import json, os, platform
import numpy as np, jax, jax.numpy as jnp
import jaxserve
from jaxserve import host_memory

x = jnp.asarray(np.arange(6 << 20, dtype=np.float32))  # 24 MB: at least 10 whole aligned 2 MB pages
before = float(jnp.sum(x[::997]))
collapsed = host_memory.huge_pages([x, jnp.ones(4)])  # the small one is skipped
start = x.addressable_shards[0].data.unsafe_buffer_pointer()
start = -(-start // (2 << 20)) * (2 << 20)  # the first whole huge page (the advice splits it into its own mapping)
huge_kb, inside = 0, False
with open("/proc/self/smaps") as fh:  # the mapping that holds it: its AnonHugePages
    for line in fh:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= start < hi
        elif inside and head == "AnonHugePages:":
            huge_kb = int(line.split()[1])
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
mode = open(THP).read() if os.path.exists(THP) else "[never]"
print(json.dumps({"collapsed": collapsed, "nbytes": x.nbytes, "same": float(jnp.sum(x[::997])) == before,
                  "huge_kb": huge_kb, "thp_never": "[never]" in mode, "kernel": platform.release()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise on Linux")
def test_resident_buffers_go_to_huge_pages():
    """Whole aligned 2 MB pages of a buffer are collapsed where the kernel can (Linux >= 6.1, THP not `never`),
    the data unchanged; with glibc's defaults asked for, nothing is advised."""
    tuned, default = probe(HUGE_PROBE), probe(HUGE_PROBE, JAXSERVE_HOST_MALLOC="default")
    assert tuned["same"] and default["same"]
    assert default["collapsed"] == 0
    assert tuned["collapsed"] % (2 << 20) == 0 and tuned["collapsed"] <= tuned["nbytes"]
    major, minor = (int(v) for v in tuned["kernel"].split(".")[:2])
    if (major, minor) >= (6, 1) and not tuned["thp_never"]:
        assert tuned["collapsed"] >= tuned["nbytes"] - 2 * (2 << 20), tuned
        assert tuned["huge_kb"] * 1024 >= tuned["collapsed"], tuned
