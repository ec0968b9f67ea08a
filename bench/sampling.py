"""The on-device sampler's cost per step (jaxserve.engine.sampler.sample) at a decode step's row counts, greedy and
random, beside the draw it replaced (threefry Gumbel noise for every token, XLA's argmax), interleaved in one
process. The vocabulary is the `small` peers model's (32000).

    python bench/sampling.py [--rows 1 16 64] [--vocab 32000] [--rounds 30]
"""
import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine import sampler
from jaxserve.engine.sampler import SamplingFlags, SlotState
from moe_grouped import timed  # bench/


def threefry_draw(logits, state, slots, positions):
    """The previous random draw: threefry noise for every token, then XLA's argmax (greedy and random)."""
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(state.seed[slots], positions)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[1],), jnp.float32))(keys)
    temperature = state.temperature[slots][:, None]
    drawn = jnp.argmax(logits / temperature + noise, axis=-1)
    return jnp.where(temperature[:, 0] > 0, drawn, jnp.argmax(logits, axis=-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for rows in args.rows:
        logits = jnp.asarray(rng.standard_normal((rows, args.vocab)), jnp.float32)
        state = dataclasses.replace(SlotState.zeros(rows + 1, 8), temperature=jnp.ones((rows + 1,), jnp.float32))
        slots, positions = jnp.arange(1, rows + 1, dtype=jnp.int32), jnp.full((rows,), 3, jnp.int32)
        for mode in ("greedy", "random"):
            flags = jnp.asarray((SamplingFlags.RANDOM if mode == "random" else SamplingFlags(0)).as_array())
            ours = timed(jax.jit(sampler.sample), logits, state, slots, positions, flags, repeats=args.rounds)
            line = f"rows {rows:3d} {mode:6s}: sample {ours * 1e3:6.2f} ms"
            if mode == "random":
                before = timed(jax.jit(threefry_draw), logits, state, slots, positions, repeats=args.rounds)
                line += f", threefry draw {before * 1e3:6.2f} ms ({before / ours:.1f}x)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
