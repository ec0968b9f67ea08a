"""The decoder of every supported family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2/3) as a Flax NNX
module. The families differ only in the ModelConfig fields that `jaxserve.config.FAMILY_FIELDS` sets per family
(biases, q/k norms, Gemma's norm weighting, sandwich norms, GeGLU, soft-capping, per-layer windows and ropes) and
in their converter tables (jaxserve.convert.names); this file reads those fields, nothing else names a family.

Each weight is declared once in `weight_specs` (shape, logical axes, initialiser); the module, the converter's
shape checks and the sharding rules all derive from that table. Layers are stacked ([layers, ...]) and run
under `jax.lax.scan`, so compile time does not grow with depth.

Forward contract (pure; the engine wraps it in jit with the cache donated):

    hidden, cache = model(tokens [T], cache, meta, kernels)      # kernels: jaxserve.models.kernels.Kernels
    logits = model.logits(hidden[rows], kernels)                # [rows, vocab] float32

Quantized models (cfg.quantization, cfg.lm_head_quantization; see jaxserve.quant.schemes) declare the same
weights: each quantized projection is a QuantizedWeight (int values + float32 scales) in place of its Param,
derived from the same WeightSpec by `weight_scheme` and `jaxserve.quant.schemes.layout`. Embeddings, norms and
biases stay float.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import SLIDING, ModelConfig
from jaxserve.kv.cache import AttentionMetadata, KVCache
from jaxserve.models import layers, moe, rope
from jaxserve.models.attention import attend_paged, reference_attention
from jaxserve.models.kernels import XLA, Kernels
from jaxserve.models.linear import (QuantizedWeight, pack_stacked, read_in_place, stacked_dense, stacked_dense_group,
                                   stored_dtype)
from jaxserve.models.linear import dense as _dense
from jaxserve.quant import schemes
from jaxserve.quant.kv import dequantize_kv, quantize_kv


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, mapped to mesh axes by jaxserve.parallel
    init: str = "normal"  # normal | ones | zeros
    contract: int = 1  # leading (after "layers") input dims a dense product contracts; 0 for non-matmul weights


def layer_weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Per-layer weights, stacked on a leading `layers` axis."""
    L, E, F, H, K, D = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                        cfg.num_kv_heads, cfg.head_dim)
    norm = "zeros" if cfg.norm_offset else "ones"  # a norm that multiplies by (1 + w) starts at w = 0
    specs = {
        "attn_norm": WeightSpec((L, E), ("layers", "norm"), norm, 0),
        "wq": WeightSpec((L, E, H, D), ("layers", "embed", "heads", "head_dim")),
        "wk": WeightSpec((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": WeightSpec((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": WeightSpec((L, H, D, E), ("layers", "heads", "head_dim", "embed"), contract=2),
        "mlp_norm": WeightSpec((L, E), ("layers", "norm"), norm, 0),
    }
    if cfg.is_moe:  # router (kept float: contract 0) and stacked experts [layers, experts, ...]
        X = cfg.num_experts
        specs["router"] = WeightSpec((L, E, X), ("layers", "embed", None), contract=0)
        specs["we_gate"] = WeightSpec((L, X, E, F), ("layers", "experts", "embed", "mlp"), contract=0)
        specs["we_up"] = WeightSpec((L, X, E, F), ("layers", "experts", "embed", "mlp"), contract=0)
        specs["we_down"] = WeightSpec((L, X, F, E), ("layers", "experts", "mlp", "embed"), contract=0)
    else:
        specs["w_gate"] = WeightSpec((L, E, F), ("layers", "embed", "mlp"))
        specs["w_up"] = WeightSpec((L, E, F), ("layers", "embed", "mlp"))
        specs["w_down"] = WeightSpec((L, F, E), ("layers", "mlp", "embed"))
    if cfg.qkv_bias:
        specs["bq"] = WeightSpec((L, H, D), ("layers", "heads", "head_dim"), "zeros", 0)
        specs["bk"] = WeightSpec((L, K, D), ("layers", "kv_heads", "head_dim"), "zeros", 0)
        specs["bv"] = WeightSpec((L, K, D), ("layers", "kv_heads", "head_dim"), "zeros", 0)
    if cfg.qk_norm:
        specs["q_norm"] = WeightSpec((L, D), ("layers", "head_dim"), norm, 0)
        specs["k_norm"] = WeightSpec((L, D), ("layers", "head_dim"), norm, 0)
    if cfg.sandwich_norms:
        specs["attn_post_norm"] = WeightSpec((L, E), ("layers", "norm"), norm, 0)
        specs["mlp_post_norm"] = WeightSpec((L, E), ("layers", "norm"), norm, 0)
    return specs


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Every weight of the model by path ("embed", "layers/wq", ...)."""
    specs = {"embed": WeightSpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), contract=0)}
    specs.update({f"layers/{name}": spec for name, spec in layer_weight_specs(cfg).items()})
    specs["final_norm"] = WeightSpec((cfg.hidden_size,), ("norm",), "zeros" if cfg.norm_offset else "ones", 0)
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = WeightSpec((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
    return specs


def weight_scheme(path: str, spec: WeightSpec, cfg: ModelConfig) -> str | None:
    """How weight `path` is stored: None (float) or a jaxserve.quant scheme. The decoder layers' projections
    follow cfg.quantization, the untied LM head cfg.lm_head_quantization; embeddings, norms and biases stay float."""
    if path == "lm_head":
        return cfg.lm_head_quantization
    if path.startswith("layers/") and spec.contract > 0:
        return cfg.quantization
    return None


def _init(spec: WeightSpec, dtype, key: jax.Array | None) -> jax.Array:
    if spec.init == "ones":
        return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros" or key is None:
        return jnp.zeros(spec.shape, dtype)
    return (0.02 * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)


def _weight(spec: WeightSpec, scheme: str | None, dtype, key: jax.Array | None, stacked: int):
    """The module attribute for one declared weight: a Param, or a QuantizedWeight of the initialised weight."""
    value = _init(spec, dtype, key)
    if scheme is None:
        return nnx.Param(value, axes=spec.axes)
    arrays = schemes.quantize_stacked(value, spec.contract, scheme, stacked)
    return QuantizedWeight.from_arrays(arrays, schemes.layout(spec.shape, spec.axes, spec.contract, scheme, stacked),
                                       scheme, spec.contract)


class DecoderLayers(nnx.Module):
    """All decoder layers; attributes hold stacked weights [layers, ...]. Called on one layer's slice."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None):
        for name, spec in layer_weight_specs(cfg).items():
            key = rngs.params() if rngs is not None else None
            setattr(self, name, _weight(spec, weight_scheme(f"layers/{name}", spec, cfg), dtype, key, stacked=1))

    PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

    def __call__(self, x, cos, sin, attend, cfg: ModelConfig, kernels: Kernels = XLA, lora_mask=None, in_place=(),
                 keep=None):
        """One layer. x: [..., T, hidden]; `attend(q, k, v) -> (out, aux)` does the attention (paged or dense)
        and `aux` (the updated cache, for the paged path) is handed back to the caller. With adapter slots
        attached (jaxserve.lora.weights), lora_mask [..., T, slots] selects each token's adapter. `in_place`:
        (names, layer index, real rows) of projections whose weights are still stacked, read in place by
        kernels.stacked_matmul, and how many of the leading tokens are real (the rest padding, skipped).
        `keep`: (order [T] int32, rows int32 scalar) when only some rows of the output are wanted: after the
        attention (which every token's K and V need) the tokens are gathered in `order`, so output row i is token
        order[i]'s, and the projections read in place multiply only the leading `rows` (the rest come out as
        whatever the zero products give: not wanted)."""
        stacked, index, rows = in_place or ((), None, None)

        def with_lora(out, inputs, name: str, mask):
            if mask is None:
                return out
            return (out + self.lora.delta(name, inputs, mask)).astype(out.dtype)

        def dense(inputs, name: str, spec: str, rows=rows, mask=lora_mask):
            kept = name in stacked
            out = _dense(inputs, getattr(self, name), spec, kernels=kernels, layer=index if kept else None,
                         rows=rows if kept else None)
            return with_lora(out, inputs, name, mask)

        def dense_group(inputs, names: tuple[str, ...], spec: str, rows=rows, mask=lora_mask):
            """[dense(inputs, name, spec) for name in names], in one kernel call when it reads them all in place."""
            if not set(names) <= set(stacked):
                return [dense(inputs, name, spec, rows, mask) for name in names]
            outs = stacked_dense_group(inputs, [getattr(self, name) for name in names], spec, kernels, index, rows)
            return [with_lora(out.astype(inputs.dtype), inputs, name, mask)
                    for out, name in zip(outs, names, strict=True)]

        norm = functools.partial(layers.rms_norm, eps=cfg.rms_norm_eps, offset=cfg.norm_offset)
        h = norm(x, self.attn_norm[...])
        q, k, v = dense_group(h, ("wq", "wk", "wv"), "...te,ehd->...thd")
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if cfg.qk_norm:
            q, k = norm(q, self.q_norm[...]), norm(k, self.k_norm[...])
        q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
        attn, aux = attend(q, k, v)
        if keep is not None:
            order, kept_rows = keep
            attn, x = jnp.take(attn, order, axis=-3, mode="clip"), jnp.take(x, order, axis=-2, mode="clip")
            mask = None if lora_mask is None else jnp.take(lora_mask, order, axis=-2, mode="clip")
            dense, dense_group = (functools.partial(f, rows=kept_rows, mask=mask) for f in (dense, dense_group))
        out = dense(attn, "wo", "...thd,hde->...te")
        x = x + (norm(out, self.attn_post_norm[...]) if cfg.sandwich_norms else out)
        out = self._mlp(norm(x, self.mlp_norm[...]), cfg, dense, dense_group, kernels)
        return x + (norm(out, self.mlp_post_norm[...]) if cfg.sandwich_norms else out), aux

    def _mlp(self, h, cfg: ModelConfig, dense, dense_group, kernels: Kernels):
        activation = layers.ACTIVATIONS[cfg.hidden_act]
        if cfg.is_moe:
            return moe.routed_mlp(h, self.router[...], self.we_gate[...], self.we_up[...], self.we_down[...],
                                  top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob, activation=activation,
                                  grouped_matmul=kernels.grouped_matmul)
        gate, up = dense_group(h, ("w_gate", "w_up"), "...te,ef->...tf")
        return dense(activation(gate) * up, "w_down", "...tf,fe->...te")


class Llama(nnx.Module):
    """The decoder. `cfg` and the kernels bundle are static; everything else is arrays."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        specs = weight_specs(cfg)
        key = (lambda: rngs.params()) if rngs is not None else (lambda: None)
        self.embed = nnx.Param(_init(specs["embed"], dtype, key()), axes=specs["embed"].axes)
        self.layers = DecoderLayers(cfg, dtype, rngs)
        self.final_norm = nnx.Param(_init(specs["final_norm"], dtype, None), axes=specs["final_norm"].axes)
        if not cfg.tie_word_embeddings:
            self.lm_head = _weight(specs["lm_head"], weight_scheme("lm_head", specs["lm_head"], cfg), dtype, key(),
                                   stacked=0)

    @property
    def dtype(self):
        return self.embed.dtype

    def __call__(self, tokens: jax.Array, cache: KVCache, meta: AttentionMetadata,
                 kernels: Kernels = XLA, lora_slots: jax.Array | None = None,
                 wanted: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, KVCache]:
        """tokens [T] int32 -> final hidden states [T, hidden] (before the final norm), updated cache.
        lora_slots [T] int32: each token's adapter slot (0: none), when adapter slots are attached.

        wanted (only where prunes_rows(kernels)): (order [T] int32, rows int32 scalar) when only the final hidden
        states of tokens order[:rows] are wanted (those logits are taken at). Every layer but the last runs on all
        tokens; the last gathers the tokens in `order` after its attention and multiplies only the leading `rows`
        through its output projection and MLP, so row i of the result is token order[i]'s for i < rows (the rest
        are not wanted). In a prompt step that is most of the last layer's products."""
        cfg = self.cfg
        x = self._embed(tokens)
        rope_of_layer = self._rope(meta.positions, x.dtype)
        lora_mask = self._lora_mask(lora_slots, x.dtype)
        in_place = self._read_in_place(kernels)
        real_tokens = meta.real_tokens() if in_place else None  # the padding's rows are skipped
        if wanted is not None and not self.prunes_rows(kernels):
            raise ValueError("only a model whose output projection and MLP are read in place prunes rows")

        def one_layer(layer, carry, index):
            x, cache = carry

            def attend(q, k, v):
                return attend_paged(q, k, v, cache, index, meta, sliding_window=self._window(index),
                                    scale=cfg.attention_scale, softcap=cfg.attn_logit_softcapping, kernels=kernels)

            keep = None
            if wanted is not None:  # the same body for every layer: the others keep every token in place
                last = index == cfg.num_layers - 1
                keep = (jnp.where(last, wanted[0], jnp.arange(x.shape[-2], dtype=jnp.int32)),
                        jnp.where(last, wanted[1], real_tokens))
            return layer(x, *rope_of_layer(index), attend, cfg, kernels, lora_mask,
                         in_place=(in_place, index, real_tokens), keep=keep)

        return self._scan_layers(one_layer, (x, cache), keep_stacked=in_place)

    def _lora_mask(self, lora_slots: jax.Array | None, dtype) -> jax.Array | None:
        if lora_slots is None or not hasattr(self.layers, "lora"):
            return None
        return self.layers.lora.token_mask(lora_slots, dtype)

    def forward_dense(self, tokens: jax.Array, kernels: Kernels = XLA, kv_cache_dtype=None,
                      lora_slots: jax.Array | None = None) -> jax.Array:
        """Training/scoring path without a cache: tokens [B, T] -> logits [B, T, vocab] float32, causal.

        kv_cache_dtype (int8 / float8_e4m3fn) rounds K and V as a quantized paged cache stores them (per token,
        before attention), so scoring here gives what the engine computes with that cache. lora_slots [B, T]:
        each token's adapter slot, as in __call__."""
        cfg = self.cfg
        x = self._embed(tokens)
        rope_of_layer = self._rope(jnp.arange(tokens.shape[1]), x.dtype)
        lora_mask = self._lora_mask(lora_slots, x.dtype)

        def dense_attention(q, k, v, window):
            if kv_cache_dtype is not None:
                k, v = (dequantize_kv(*quantize_kv(t, kv_cache_dtype), t.dtype) for t in (k, v))
            return jax.vmap(lambda *qkv: reference_attention(
                *qkv, sliding_window=window, scale=cfg.attention_scale, softcap=cfg.attn_logit_softcapping))(q, k, v)

        def one_layer(layer, x, index):
            attend = lambda *qkv: (dense_attention(*qkv, self._window(index)), None)  # noqa: E731
            return layer(x, *rope_of_layer(index), attend, cfg, kernels, lora_mask)[0]

        return self.logits(self._scan_layers(one_layer, x), kernels)

    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = self.embed[...][tokens]
        if self.cfg.scale_embeddings:  # sqrt(hidden) rounded to the model dtype first, as transformers does
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, x.dtype)
        return x

    def _rope(self, positions, dtype):
        """layer index -> (cos, sin) of that layer. One table unless sliding layers have their own (Gemma 3)."""
        cfg = self.cfg
        tables = [rope.rope_cos_sin(positions, *rope.rope_frequencies(r, cfg.head_dim), dtype)
                  for r in (cfg.rope, cfg.local_rope) if r is not None]
        if len(tables) == 1:
            return lambda index: tables[0]
        is_sliding = jnp.asarray([kind == SLIDING for kind in cfg.layer_types])
        return lambda index: jax.tree.map(lambda full, local: jnp.where(is_sliding[index], local, full), *tables)

    def _window(self, index):
        """The layer's sliding window: a Python int (or None) when every layer has the same, else the traced
        int32 of layer `index` (0: that layer attends to the whole context)."""
        windows = self.cfg.layer_windows()
        if len(set(windows)) == 1:
            return windows[0]
        return jnp.asarray([w or 0 for w in windows], jnp.int32)[index]

    def _read_in_place(self, kernels: Kernels) -> tuple[str, ...]:
        """The projections whose stacked weights kernels.stacked_matmul reads in place."""
        if kernels.stacked_matmul is None:
            return ()
        return tuple(name for name in DecoderLayers.PROJECTIONS  # MoE: no MLP ones
                     if hasattr(self.layers, name) and read_in_place(weight := getattr(self.layers, name))
                     and kernels.reads_stacked(stored_dtype(weight)))

    def prunes_rows(self, kernels: Kernels) -> bool:
        """Whether __call__ can skip the last layer's output projection and MLP for unwanted tokens: the kernel
        reads those weights in place, and it multiplies only the leading rows it is told are wanted."""
        return {"wo", "w_gate", "w_up", "w_down"} <= set(self._read_in_place(kernels))

    def _lm_head_in_place(self, kernels: Kernels) -> bool:
        """Whether kernels.stacked_matmul reads the (untied) LM head in place."""
        return (not self.cfg.tie_word_embeddings and read_in_place(self.lm_head)
                and kernels.reads_stacked(stored_dtype(self.lm_head)))

    def _scan_layers(self, body, carry, keep_stacked: tuple[str, ...] = ()):
        """Runs body(layer_module, carry, layer_index) -> carry over the stacked layers with lax.scan. The weights
        named in `keep_stacked` stay whole [layers, ...] in the layer module (read in place by a kernel)."""
        graphdef, stacked = nnx.split(self.layers)

        def layer_slice(path, w, index):
            if path[0].key in keep_stacked:
                return w
            return jax.lax.dynamic_index_in_dim(w, index, keepdims=False)

        def step(carry, index):
            # Index the stacked weights inside the body rather than scanning over them as xs: XLA:CPU then feeds
            # each layer's slice to its dot instead of first copying it out (the copies were ~15% of a decode step).
            layer_state = jax.tree_util.tree_map_with_path(lambda p, w: layer_slice(p, w, index), stacked)
            return body(nnx.merge(graphdef, layer_state), carry, index), None

        carry, _ = jax.lax.scan(step, carry, jnp.arange(self.cfg.num_layers, dtype=jnp.int32))
        return carry

    def logits(self, hidden: jax.Array, kernels: Kernels = XLA, rows=None) -> jax.Array:
        """[..., hidden] -> [..., vocab] float32 logits (applies the final norm). `rows` (int32 scalar, None: all):
        the leading rows that are real; a kernel that reads the LM head in place may return zeros past them."""
        h = layers.rms_norm(hidden, self.final_norm[...], self.cfg.rms_norm_eps, self.cfg.norm_offset)
        if self.cfg.tie_word_embeddings:
            logits = jnp.einsum("...e,ve->...v", h, self.embed[...], preferred_element_type=jnp.float32)
        elif self._lm_head_in_place(kernels):
            logits = stacked_dense(h, self.lm_head, "...e,ev->...v", kernels, rows=rows)  # [hidden, vocab]: one "layer"
        else:
            logits = _dense(h, self.lm_head, "...e,ev->...v", out_dtype=jnp.float32, kernels=kernels)
        return layers.softcap(logits, self.cfg.final_logit_softcapping)


def pack_weights(model: Llama, kernels: Kernels) -> Llama:
    """`model` with the weights kernels.stacked_matmul reads in place stored in the layout it streams fastest
    (kernels.pack, jaxserve.cpu.pack) where their shapes allow: what a CPU engine reads every step, read in long
    sequential runs. Takes the model over: each packed weight's original array is freed as soon as its copy exists
    (the weights are never in memory twice), so `model` must not be used afterwards. The result's __call__ and
    logits run with these kernels only (forward_dense and other kernels want the plain layout)."""
    if kernels.pack is None:
        return model
    packed = nnx.clone(model)  # new modules over the same arrays
    specs = weight_specs(model.cfg)
    targets = [(packed.layers, name, specs[f"layers/{name}"].contract, True) for name in model._read_in_place(kernels)]
    if model._lm_head_in_place(kernels):
        targets.append((packed, "lm_head", specs["lm_head"].contract, False))
    for owner, name, contract, stacked in targets:
        weight = getattr(owner, name)
        quantized = isinstance(weight, QuantizedWeight)
        variable = weight.values if quantized else weight
        new = pack_stacked(variable, weight.contract if quantized else contract, stacked, kernels.pack)
        if new is variable:
            continue
        if quantized:
            weight.values = new
        else:
            setattr(owner, name, new)
        variable[...].delete()
    return packed


def kept_in_storage(cfg: ModelConfig, dtype: str, kernels: Kernels) -> tuple[str, ...]:
    """The weights of a `cfg` checkpoint to load in its own dtype when the model runs in `dtype`: those
    kernels.stacked_matmul reads in place, when the model runs in float32 and the kernel reads the checkpoint's
    dtype. The kernel converts each weight to float32 as it multiplies, and a bfloat16 value is exact in float32, so
    the products are those of the upcast weights while a step reads half the bytes. Paths as load_model's
    keep_stored takes them ("layers/wq", "lm_head")."""
    if dtype != "float32" or cfg.dtype == dtype or not kernels.reads_stacked(cfg.dtype):
        return ()
    model = abstract_model(cfg, numpy_dtype(cfg.dtype))
    floating = lambda weight: not isinstance(weight, QuantizedWeight)  # noqa: E731 (quantized ones keep theirs)
    layers_ = tuple(f"layers/{name}" for name in model._read_in_place(kernels)
                    if floating(getattr(model.layers, name)))
    return layers_ + (("lm_head",) if model._lm_head_in_place(kernels) and floating(model.lm_head) else ())


def path_name(path) -> str:
    """A pytree key path of the model's weights as weight_specs names it ("layers/wq")."""
    return "/".join(str(getattr(key, "key", key)) for key in path)


def abstract_weights(cfg: ModelConfig, dtype, keep_stored: Collection[str] = ()):
    """(graphdef, Param state with ShapeDtypeStruct leaves) of a `cfg` checkpoint as it loads to run in `dtype`:
    float weights in `dtype`, but those whose path is in keep_stored (kept_in_storage) in the checkpoint's dtype;
    integer and keep_dtype ones (quantized values, their scales) as declared."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype), nnx.Param)

    def leaf(path, var: nnx.Variable) -> nnx.Variable:
        value = var.get_value()
        if not jnp.issubdtype(value.dtype, jnp.floating) or var.get_metadata().get("keep_dtype", False):
            return var
        stored = path_name(path) in keep_stored
        return var.replace(jax.ShapeDtypeStruct(value.shape, numpy_dtype(cfg.dtype) if stored else dtype))

    return graphdef, jax.tree_util.tree_map_with_path(leaf, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def stored_dtypes(model: Llama) -> dict[str, str]:
    """The float weights stored in another dtype than the model runs in (kept_in_storage), by path."""
    specs = weight_specs(model.cfg)
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    paths = {path_name(path): value.dtype for path, value in flat}
    return {path: jnp.dtype(dtype).name for path, dtype in paths.items()
            if path in specs and jnp.issubdtype(dtype, jnp.floating) and dtype != model.dtype}


def abstract_model(cfg: ModelConfig, dtype=jnp.bfloat16) -> Llama:
    """The model with ShapeDtypeStruct leaves: shapes and axes without allocating anything."""
    return nnx.eval_shape(lambda: Llama(cfg, dtype, rngs=nnx.Rngs(0)))


def random_model(cfg: ModelConfig, dtype=jnp.bfloat16, seed: int = 0) -> Llama:
    """A randomly initialised model, built on device in one compiled call (fast even for 8B shapes); the call is
    compiled once per config and dtype, the seed is its argument."""
    try:
        hash(cfg)
        builder = _random_builder
    except TypeError:  # an unhashable config (a list where a tuple belongs): compiled for this call alone
        builder = _random_builder.__wrapped__
    graphdef, build = builder(cfg, jnp.dtype(dtype))
    return nnx.merge(graphdef, build(jnp.int32(seed)))


@functools.lru_cache(maxsize=16)
def _random_builder(cfg: ModelConfig, dtype):
    graphdef, _ = nnx.split(abstract_model(cfg, dtype))
    return graphdef, jax.jit(lambda seed: nnx.state(Llama(cfg, dtype, rngs=nnx.Rngs(jax.random.key(seed)))))


def numpy_dtype(name: str):
    return {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[name]


__all__ = ["Llama", "WeightSpec", "weight_specs", "layer_weight_specs", "weight_scheme", "abstract_model",
           "random_model", "numpy_dtype"]
