"""The fused step executable (model + sampling, what the engine runs) vs the same work split in two executables
(model, then sampling: the engine before issue 13), same engine, params and cache, interleaved 40 times: decode
B=1 and B=64 on the small preset. `--plain` compiles the fused step without the sharding constraints.
Run it with JAXSERVE_HOST_MALLOC=default to see what glibc's defaults cost (RESULTS.md, "Follow-up").

    python bench/fused_step_ab.py [--plain]
"""
import functools
import statistics
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import jax
import numpy as np

from offline_throughput import preset_config
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import EngineCore
from jaxserve.engine.buckets import StepShape
from jaxserve.engine.runner import model_step, sample_step, step, StepInputs
from jaxserve.engine.sampler import SamplingFlags
from jaxserve.models.llama import numpy_dtype, random_model

cfg = preset_config("small", "bfloat16")
core = EngineCore(random_model(cfg, numpy_dtype("float32"), seed=0),
                  EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=256), show_progress=False)
r = core.runner
results = {}
for B in (1, 64):
    shape = next(s for s in r.buckets.shapes() if s.kind == "decode" and s.seqs == B)
    pages = shape.pages
    inputs = StepInputs(np.tile(np.arange(1, pages + 1, dtype=np.int32), (B, 1)) % (core.kv_plan.num_pages - 1) + 1,
                        np.full(B, 100, np.int32), np.arange(B + 1, dtype=np.int32), np.arange(1, B + 1, dtype=np.int32),
                        np.ones(B, bool), SamplingFlags.NONE.as_array(), np.zeros(B, np.int32))
    fused = r.executables[shape] if "--plain" not in sys.argv else jax.jit(functools.partial(
        step, r.graphdef, shape=shape, page_size=r.page_size, kernels=r.kernels, sharder=None), donate_argnums=(1, 2))
    m = jax.jit(functools.partial(model_step, r.graphdef, shape=shape, page_size=r.page_size, kernels=r.kernels),
                donate_argnums=1)
    smp = jax.jit(sample_step, donate_argnums=1)
    def run_fused():
        r.kv, r.slots, out, _ = fused(r.params, r.kv, r.slots, inputs)
        out.tokens.block_until_ready()
    def run_split():
        r.kv, mo = m(r.params, r.kv, r.slots.tokens, inputs)
        r.slots, out = smp(mo.logits, r.slots, inputs.row_slots, inputs.context_lens, inputs.sample_mask, inputs.flags)
        out.tokens.block_until_ready()
    for f in (run_fused, run_split, run_fused, run_split):
        f()
    t = {"fused": [], "split": []}
    for _ in range(40):
        for name, f in (("fused", run_fused), ("split", run_split)):
            s = time.perf_counter(); f(); t[name].append(time.perf_counter() - s)
    fz, sp = statistics.median(t["fused"]), statistics.median(t["split"])
    print(f"B={B}: fused {fz*1e3:.2f} ms, split {sp*1e3:.2f} ms, fused/split {fz/sp:.3f}", flush=True)
