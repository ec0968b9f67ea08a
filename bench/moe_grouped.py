#!/usr/bin/env python3
"""One MoE layer's expert matmuls: jaxserve's grouped path against the floor of the experts actually hit.

For each token count T: T random tokens routed top-k over X experts (the router of jaxserve.models.moe), then

    ragged_dot      jaxserve.models.moe.routed_mlp with jax.lax.ragged_dot (the GPU's default: XLA's ragged dot)
    ragged_dot-pallas  the same under JAX's Pallas Triton lowering of ragged_dot (jax_ragged_dot_use_gpu_pallas_
                    triton_lowering; GPU only)
    tiled           routed_mlp with jaxserve's tiled grouped matmul (the CPU's default)
    dense-all       every expert on every token, weighted (what a loop over experts costs)
    floor           for each expert hit, one dense gated MLP over exactly its tokens (sizes fixed from this
                    routing before compiling): the matmuls that must happen, nothing else

Reports milliseconds (median of --repeats, after a warm-up) and each path's ratio to the floor, one JSON line per
(T, path). Timing claims on a shared machine: interleaved runs, same process.

    python bench/moe_grouped.py --preset small --tokens 1 16 64                   # CPU
    python bench/moe_grouped.py --preset mixtral --tokens 1 16 64 256 --out moe.json  # GPU (bench/gpu_check_moe.sh)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import moe

PRESETS = {"small": dict(hidden=512, inner=1024, experts=8, top_k=2),
           "mixtral": dict(hidden=4096, inner=14336, experts=8, top_k=2),
           "qwen3-30b-a3b": dict(hidden=2048, inner=768, experts=128, top_k=8)}


def weights(shape: dict, dtype, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    e, f, x = shape["hidden"], shape["inner"], shape["experts"]
    normal = lambda key, dims: (0.02 * jax.random.normal(key, dims, jnp.float32)).astype(dtype)  # noqa: E731
    return (normal(keys[0], (e, x)), normal(keys[1], (x, e, f)), normal(keys[2], (x, e, f)),
            normal(keys[3], (x, f, e)))


def floor_fn(experts: np.ndarray, num_experts: int):
    """The gated MLPs of the experts hit, each over exactly its token copies (sizes baked in)."""
    groups = [np.nonzero(experts.reshape(-1) == i)[0] for i in range(num_experts)]
    top_k = experts.shape[1]

    def run(h, we_gate, we_up, we_down):
        out = jnp.zeros(h.shape, jnp.float32)
        for expert, copies in enumerate(groups):
            if len(copies) == 0:
                continue
            tokens = jnp.asarray(copies // top_k)
            x = h[tokens]
            gate = jnp.dot(x, we_gate[expert], preferred_element_type=jnp.float32)
            up = jnp.dot(x, we_up[expert], preferred_element_type=jnp.float32)
            y = jnp.dot((gate * up).astype(h.dtype), we_down[expert], preferred_element_type=jnp.float32)
            out = out.at[tokens].add(y)
        return out.astype(h.dtype)

    return run


def timed(fn, *args, repeats: int, summary=statistics.median) -> float:
    """Seconds per call after one warm-up call: `summary` (median, or min for a best case) of `repeats` calls."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return summary(times)


def paths(shape: dict, experts: np.ndarray) -> dict:
    kw = dict(top_k=shape["top_k"], normalize=True, activation=lambda g: g)
    routed = lambda grouped: jax.jit(  # noqa: E731
        lambda h, r, g, u, d: moe.routed_mlp(h, r, g, u, d, **kw, grouped_matmul=grouped))
    found = {"ragged_dot": routed(moe.ragged_dot), "tiled": routed(moe.tiled_grouped_matmul),
             "dense-all": jax.jit(lambda h, r, g, u, d: moe.dense_reference(h, r, g, u, d, **kw)),
             "floor": jax.jit(lambda h, r, g, u, d: floor_fn(experts, shape["experts"])(h, g, u, d))}
    if jax.default_backend() == "gpu":  # a jit of its own, first traced and lowered under the flag
        from jax._src import config as jax_config
        ragged_pallas = routed(moe.ragged_dot)

        def pallas(*args):
            with jax_config.jax_ragged_dot_use_gpu_pallas_triton_lowering(True):
                return ragged_pallas(*args)
        found["ragged_dot-pallas"] = pallas
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the paths")
    ap.add_argument("--out", help="append the JSON lines to this file")
    args = ap.parse_args(argv)
    shape, dtype = PRESETS[args.preset], jnp.dtype(args.dtype)
    router, we_gate, we_up, we_down = weights(shape, dtype)
    for tokens in args.tokens:
        h = jax.random.normal(jax.random.key(tokens), (tokens, shape["hidden"]), jnp.float32).astype(dtype)
        experts, _ = moe.route(h, router, shape["top_k"], True)
        experts = np.asarray(experts)
        found = paths(shape, experts)
        seconds = {name: [] for name in found}
        for _ in range(args.rounds):
            for name, fn in found.items():
                seconds[name].append(timed(fn, h, router, we_gate, we_up, we_down, repeats=args.repeats))
        floor = statistics.median(seconds["floor"])
        hit = len(np.unique(experts))
        for name, values in seconds.items():
            record = dict(preset=args.preset, tokens=tokens, path=name, experts_hit=hit,
                          ms=round(statistics.median(values) * 1e3, 3),
                          vs_floor=round(statistics.median(values) / floor, 2),
                          device=jax.devices()[0].device_kind, dtype=args.dtype)
            emit(record, args.out)
    return 0


def emit(record: dict, out: str | None) -> None:
    """Prints a result as one JSON line, and appends it to `out` when given."""
    print(json.dumps(record), flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.exit(main())
