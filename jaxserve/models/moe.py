"""The Mixture-of-Experts MLP (Mixtral, Qwen3-MoE): a float32 router picks each token's top-k experts; the token
copies are grouped by expert and multiplied with grouped matmuls, never a loop over experts.

    h [T, E] --router (f32)--> softmax --top-k--> (expert ids [T, k], weights [T, k], renormalised if asked)
      copies [T*k] sorted by expert:   | e0 e0 e0 | e1 | e3 e3 | ... |   group_sizes [X] (0 for an idle expert)
      gate, up = grouped(copies, w_gate / w_up)         [T*k, F]
      y = grouped(act(gate) * up, w_down)               [T*k, E]
      out[t] = sum over t's k copies of weight * y      [T, E]

Two grouped matmuls (the model takes the kernels bundle's `grouped_matmul`, `grouped_matmul` below by default:
ragged_dot, or tiled on a CPU, decided when the step is traced):

    ragged_dot   jax.lax.ragged_dot: XLA's ragged dot on a GPU (or JAX's Pallas Triton kernel behind
                 jax_ragged_dot_use_gpu_pallas_triton_lowering; bench/moe_grouped.py measures both). On a CPU, JAX
                 lowers it to a dense product of every group with every row, masked: X times the FLOPs.
    tiled        rows cut into tiles of one expert each (each group padded to whole tiles), every tile multiplied
                 by its expert's weights (gathered) in one batched product: the FLOPs of the routed rows plus the
                 padding. The CPU's choice for decode-sized steps (at most one row per expert), where it reads
                 only the experts hit; larger CPU steps keep ragged_dot (faster there, measured).

Parallelism (logical axis "experts", jaxserve.parallel): expert parallelism when the experts divide over the
devices: each device holds its share of the experts, runs the grouped matmuls for the copies routed to them
(the others sort past the last group and are skipped) and the partial outputs are summed across devices (the
exchange that brings each token its experts' results; the tokens themselves are replicated, as every
activation between layers is). Otherwise the experts stay whole and each one's MLP splits like a dense MLP
(tensor parallelism inside the experts: gate/up column-, down row-parallel), the partial sums summed the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.parallel import shard_map_logical

EXPERT_IN = P("experts", "embed", "mlp")  # we_gate, we_up: [X, E, F]
EXPERT_OUT = P("experts", "mlp", "embed")  # we_down: [X, F, E]


def route(h: jax.Array, router: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """h [T, E], router [E, X] -> (expert ids [T, k] int32, routing weights [T, k] float32), computed in float32."""
    logits = jnp.einsum("te,ex->tx", h.astype(jnp.float32), router.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] (rows grouped, group g's rows after group g-1's), w [G, K, N], group_sizes [G] -> [M, N] float32;
    rows past the last group give zeros."""
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


def tiled_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """ragged_dot's contract, computed tile by tile: each group's rows padded to whole tiles of `block` rows, each
    tile multiplied by its group's weights (one batched product over the tiles; a tile's weights are gathered).

        rows   | g0 g0 g0 | g1 | g3 g3 g3 g3 g3 |      block = 2
        tiles  | g0 g0 | g0 -- | g1 -- | g3 g3 | g3 g3 | g3 -- | (unused) |
    """
    m, _ = x.shape
    g = w.shape[0]
    block = _tile_rows(m, g)
    num_tiles = (m + min(m, g) * (block - 1)) // block  # at most min(m, g) groups are non-empty
    tiles_per_group = (group_sizes + block - 1) // block
    tile_end = jnp.cumsum(tiles_per_group)
    row_end = jnp.cumsum(group_sizes)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    used = t < tile_end[-1]
    last_used = jnp.maximum(tile_end[-1] - 1, 0)
    group = jnp.searchsorted(tile_end, jnp.where(used, t, last_used), side="right").astype(jnp.int32)
    group = jnp.minimum(group, g - 1)  # unused tiles repeat the last used tile's group (no extra weights read)
    first = (row_end[group] - group_sizes[group]) + (t - (tile_end[group] - tiles_per_group[group])) * block
    rows = first[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]  # [tiles, block]
    valid = used[:, None] & (rows < row_end[group][:, None])
    xt = jnp.where(valid[..., None], x[jnp.clip(rows, 0, m - 1)], 0)
    yt = jnp.einsum("tbk,tkn->tbn", xt, w[group], preferred_element_type=jnp.float32)
    out = jnp.zeros((m, w.shape[-1]), jnp.float32)
    return out.at[jnp.where(valid, rows, m).reshape(-1)].set(yt.reshape(-1, w.shape[-1]), mode="drop")


def _tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: a group's even share rounded up to a power of 2 (1..256)."""
    share = -(-rows // groups)
    return min(256, 1 << max(0, share - 1).bit_length())


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """ragged_dot, except on a CPU for at most one row per expert (decode-sized steps; decided when traced): the
    tiled product, one row per tile, which reads only the experts hit. Measured on this 2-core CPU under load
    (bench/moe_grouped.py, preset small): 1 token: tiled 1.4 ms, ragged_dot 64 ms; 16 tokens: 233 vs 52 ms."""
    small = jax.default_backend() == "cpu" and x.shape[0] <= w.shape[0]
    return (tiled_grouped_matmul if small else ragged_dot)(x, w, group_sizes)


def routed_mlp(h: jax.Array, router, we_gate, we_up, we_down, *, top_k: int, normalize: bool,
               activation, grouped_matmul=grouped_matmul) -> jax.Array:
    """The MoE MLP of one layer. h: [T, E] (any leading dims are flattened); expert weights [X, E, F] / [X, F, E];
    grouped_matmul: ragged_dot's contract (the engine's kernels bundle passes jaxserve.models.kernels')."""
    lead = h.shape[:-1]
    h = h.reshape(-1, h.shape[-1])
    experts, weights = route(h, router, top_k, normalize)
    expert_ids = jnp.arange(we_gate.shape[0], dtype=jnp.int32)  # split with the experts: a shard's first id
    local = lambda *args: _local_experts(*args, activation=activation, grouped=grouped_matmul)  # noqa: E731
    out = shard_map_logical(local, in_specs=(P(), P(), P(), P("experts"), EXPERT_IN, EXPERT_IN, EXPERT_OUT),
                            out_specs=P(), sum_over=("experts", "mlp"))(
        h, experts, weights, expert_ids, we_gate, we_up, we_down)
    return out.astype(h.dtype).reshape(*lead, h.shape[-1])


def _local_experts(h, experts, weights, expert_ids, we_gate, we_up, we_down, *, activation, grouped):
    """The contribution of the experts this device holds (all of them on one device) to every token: [T, E] f32."""
    num_tokens, top_k = experts.shape
    num_local = we_gate.shape[0]
    slot = experts.reshape(-1) - expert_ids[0]  # the copy's expert among the local ones
    is_local = (slot >= 0) & (slot < num_local)
    slot = jnp.where(is_local, slot, num_local)  # other devices' copies sort last and fall in no group
    order = jnp.argsort(slot, stable=True)
    group_sizes = jnp.bincount(slot, length=num_local + 1)[:num_local].astype(jnp.int32)
    token = order // top_k
    x = h[token]  # [T*k, E], grouped by local expert
    gate, up = grouped(x, we_gate, group_sizes), grouped(x, we_up, group_sizes)
    y = grouped((activation(gate) * up).astype(h.dtype), we_down, group_sizes)  # [T*k, E]
    # rows of other devices' copies fall in no group: whatever ragged_dot left there is dropped, never scaled
    contribution = jnp.where(is_local[order][:, None], y * weights.reshape(-1)[order][:, None], 0.0)
    return jnp.zeros((num_tokens, h.shape[-1]), jnp.float32).at[token].add(contribution)


def dense_reference(h: jax.Array, router, we_gate, we_up, we_down, *, top_k: int, normalize: bool,
                    activation) -> jax.Array:
    """Every expert on every token, weighted by the routing (zero for unrouted experts), in float32: tests'
    reference (XLA:CPU has no bfloat16 x bfloat16 -> float32 batched dot for these layouts)."""
    experts, weights = route(h, router, top_k, normalize)
    dtype, (h, we_gate, we_up, we_down) = h.dtype, (a.astype(jnp.float32) for a in (h, we_gate, we_up, we_down))
    dense_weights = jnp.zeros(h.shape[:1] + we_gate.shape[:1], jnp.float32).at[
        jnp.arange(h.shape[0])[:, None], experts].set(weights)
    hp = jax.lax.Precision.HIGHEST
    gate = jnp.einsum("te,xef->txf", h, we_gate, preferred_element_type=jnp.float32, precision=hp)
    up = jnp.einsum("te,xef->txf", h, we_up, preferred_element_type=jnp.float32, precision=hp)
    y = jnp.einsum("txf,xfe->txe", activation(gate) * up, we_down, preferred_element_type=jnp.float32, precision=hp)
    return jnp.einsum("txe,tx->te", y, dense_weights, precision=hp).astype(dtype)
