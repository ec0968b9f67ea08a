"""The dense product every projection goes through, so that quantized weights plug in at one place.

    dense(x, weight, "...te,ehd->...thd", kernels=...)    weight: a float Param (or array), or a QuantizedWeight

Inside the layer scan a product can take the layer's weight still stacked [layers, ...] with its `layer` index,
when the kernels read stacked weights in place (`kernels.reads_stacked(dtype)`, the C++ CPU kernel):
then the weight is viewed as [layers, K, N] (a free reshape) and never sliced out, or it was stored packed in the
kernel's own layout once, when the engine was built (`pack_stacked`). Otherwise a float weight is one
einsum. A QuantizedWeight (int8 / int4 / fp8, with zero points and act-order where the scheme says; layouts in
`jaxserve.quant.schemes`) is multiplied as a matrix: x's trailing `contract` dims are flattened to K, the weight is
viewed as [K, N] (free reshapes), act-order gathers x's columns by the stored permutation, and the product runs
through `kernels.matmul`, the kernel the engine chose once (jaxserve.models.kernels).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.models.kernels import XLA, Kernels
from jaxserve.parallel import shard_map_logical
from jaxserve.quant import schemes
from jaxserve.quant.schemes import QuantizedLayout


class QuantizedWeight(nnx.Module):
    """A weight-only quantized weight: `values` (int8, packed int4 or fp8), float32 `scales`, and where the scheme
    has them bfloat16 `zeros` (asymmetric) and an int32 act-order `perm` [K] (layouts in jaxserve.quant.schemes).
    Everything but values and perm is kept in its dtype when the model loads in another (`keep_dtype`). `scheme`
    and `contract` are static. In DecoderLayers the arrays are stacked [layers, ...]; inside the layer scan
    `dense` sees one layer's slice."""

    def __init__(self, values: jax.Array, scales: jax.Array, layout: QuantizedLayout, scheme: str, contract: int,
                 zeros: jax.Array | None = None, perm: jax.Array | None = None):
        self.values = nnx.Param(values, axes=layout.values_axes, keep_dtype=True)
        self.scales = nnx.Param(scales, axes=layout.scales_axes, keep_dtype=True)
        self.zeros = None if zeros is None else nnx.Param(zeros, axes=layout.scales_axes, keep_dtype=True)
        self.perm = None if perm is None else nnx.Param(perm, axes=layout.perm_axes)
        self.scheme = scheme
        self.contract = contract

    @classmethod
    def from_arrays(cls, arrays: dict[str, jax.Array], layout: QuantizedLayout, scheme: str,
                    contract: int) -> "QuantizedWeight":
        """From schemes.quantize_arrays' (or the checkpoint's) {"values", "scales"[, "zeros"][, "perm"]}."""
        return cls(arrays["values"], arrays["scales"], layout, scheme, contract, arrays.get("zeros"),
                   arrays.get("perm"))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight (one layer's slice, rows in the original order), e.g. for tests and the unquantized
        comparison."""
        return schemes.dequantize(self.values[...], self.scales[...], self.contract, self.scheme, dtype,
                                  zeros=_value(self.zeros), perm=_value(self.perm))


def _value(param):
    return None if param is None else param[...]


def dense(x: jax.Array, weight, spec: str, out_dtype=None, kernels: Kernels = XLA, layer=None,
          rows=None) -> jax.Array:
    """einsum(spec, x, weight) accumulated in float32, returned in `out_dtype` (default: x's dtype). `layer`: the
    weight is stacked [layers, ...] and this layer's slice is meant (the layer scan leaves it stacked only when
    kernels.reads_stacked); then `rows` (int32 scalar, None: all) may say how many of x's leading rows are real,
    the rest padding whose products are zeros."""
    if layer is not None or packed_dims(weight) is not None:
        out = stacked_dense(x, weight, spec, kernels, layer, rows)
    elif isinstance(weight, QuantizedWeight):
        out = _quantized_dense(x, weight, spec, kernels)
    else:
        out = jnp.einsum(spec, x, weight[...], preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)


def _quantized_dense(x: jax.Array, weight: QuantizedWeight, spec: str, kernels: Kernels) -> jax.Array:
    contract, scheme = weight.contract, weight.scheme
    check_matrix_spec(spec, contract)
    values, scales = schemes.matrix(weight.values[...], weight.scales[...], contract, scheme)
    k = values.shape[0] * (2 if schemes.parse(scheme).kind == "int4" else 1)
    out_dims = weight.values[...].shape[contract:]
    x2 = x.reshape(-1, k)
    if weight.perm is not None:  # act-order: the rows are stored sorted by group, so x's columns follow them
        x2 = gather_columns(x2, weight.perm[...])
    operands = (x2, values, scales) + (() if weight.zeros is None else
                                       (schemes.scales_matrix(weight.zeros[...], scheme),))
    matmul = functools.partial(kernels.matmul, scheme=scheme)
    if kernels.matmul_under_shard_map:
        matmul = _split_like_the_weight(matmul, weight, len(operands))
    out = matmul(*operands)
    return out.reshape(x.shape[:x.ndim - contract] + tuple(out_dims))


def read_in_place(weight) -> bool:
    """Whether kernels.stacked_matmul takes this weight stacked: float weights and symmetric per-channel int8 ones;
    grouped, asymmetric, act-order and fp8 layouts keep the XLA path (sliced per layer)."""
    return not isinstance(weight, QuantizedWeight) or (weight.scheme == "int8" and weight.zeros is None
                                                       and weight.perm is None)


def stored_dtype(weight):
    """The dtype a weight is stored in (a quantized weight's values: int8 for int8 and int4 alike)."""
    return (weight.values if isinstance(weight, QuantizedWeight) else weight).get_value().dtype  # also abstract


def stacked_dense(x: jax.Array, weight, spec: str, kernels: Kernels, layer=None, rows=None) -> jax.Array:
    """x [..., K dims] @ weight[layer] [K dims, N dims] -> float32 by kernels.stacked_matmul on the weight's
    [layers, K, N] view, or on its packed values (`pack_stacked`); `layer=None`: the weight is not stacked (one
    layer). `rows`: x's leading rows (flattened to [M, K]) that are real, the others' products zeros (None: all)."""
    return stacked_dense_group(x, [weight], spec, kernels, layer, rows)[0]


def stacked_dense_group(x: jax.Array, weights, spec: str, kernels: Kernels, layer=None,
                        rows=None) -> list[jax.Array]:
    """[stacked_dense(x, w, spec, ...) for w in weights] in one kernels.stacked_matmul call (a layer's q, k and v,
    or its gate and up: a decode step waits for the kernel's threads once for them)."""
    operands = [_stacked_operand(weight, spec, layer) for weight in weights]
    _, _, layer, k_dims, _ = operands[0]
    pairs = [(values, scales) for values, scales, *_ in operands]
    outs = kernels.stacked_matmul(x.reshape(-1, math.prod(k_dims)), pairs, layer, rows)
    return [out.reshape(x.shape[:x.ndim - len(k_dims)] + tuple(n_dims))
            for out, (*_, n_dims) in zip(outs, operands, strict=True)]


def _stacked_operand(weight, spec: str, layer):
    """(values [L, K, N] or packed, scales [L, N] | None, layer, K dims, N dims) of a weight read in place."""
    quantized = isinstance(weight, QuantizedWeight)
    values = weight.values[...] if quantized else weight[...]
    packed = packed_dims(weight)
    if packed is not None:  # [layers, panels, K, panel columns]: the kernel reads it as it is
        k_dims, n_dims = packed
        if layer is None:  # one layer, or one sliced out of the stack
            values, layer = values if values.ndim == 4 else values[None], 0
    else:
        if layer is None:
            values, layer = values[None], 0
        contract = weight.contract if quantized else contraction_dims(spec)
        k_dims, n_dims = values.shape[1:1 + contract], values.shape[1 + contract:]
    check_matrix_spec(spec, len(k_dims))
    n = math.prod(n_dims)
    if packed is None:
        values = values.reshape(values.shape[0], math.prod(k_dims), n)
    scales = weight.scales[...].reshape(values.shape[0], n) if quantized else None
    return values, scales, layer, tuple(k_dims), tuple(n_dims)


def packed_dims(weight) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(K dims, N dims) of a weight whose values are stored packed (`pack_stacked`), else None."""
    variable = weight.values if isinstance(weight, QuantizedWeight) else weight
    return variable.get_metadata().get("packed") if isinstance(variable, nnx.Variable) else None


def pack_stacked(variable: nnx.Variable, contract: int, stacked: bool, pack) -> nnx.Variable:
    """A weight's values (a float weight's Param, or a QuantizedWeight's `values`) as `pack` stores them for the
    kernel that reads them in place (kernels.pack: [layers, K, N] -> its layout, None where the shape does not
    allow), with their K and N dims kept in the metadata `packed` for stacked_dense; the variable as it is when
    `pack` declines. `stacked`: the values have a leading layer dim (an LM head has none: it becomes one layer).
    A new variable; `variable` and its array are left as they were."""
    values = variable[...]
    values = values if stacked else values[None]
    k_dims, n_dims = values.shape[1:1 + contract], values.shape[1 + contract:]
    packed = pack(values.reshape(values.shape[0], math.prod(k_dims), math.prod(n_dims)))
    if packed is None:
        return variable
    return variable.replace(packed, packed=(tuple(k_dims), tuple(n_dims)))


def contraction_dims(spec: str) -> int:
    """How many leading dims of the weight an einsum spec `...x,w->...o` contracts with x's trailing ones."""
    lhs, rhs = spec.replace(" ", "").split("->")[0].split(",")
    return next((i for i, c in enumerate(rhs) if c not in lhs), len(rhs))


def gather_columns(x: jax.Array, perm: jax.Array) -> jax.Array:
    """x[:, perm], materialized (optimization_barrier) rather than fused into the product: XLA:CPU cannot run a
    bfloat16 dot (float32 result) whose operand is a fused gather ("Unsupported element type for DotThunk"), and
    a transposed gather there runs the dot ~1.5x slower. A Pallas kernel takes a materialized operand anyway."""
    return jax.lax.optimization_barrier(jnp.take(x, perm, axis=1))


def _split_like_the_weight(matmul, weight: QuantizedWeight, num_operands: int):
    """Tensor parallelism for the Pallas kernel, which GSPMD cannot partition (it would gather the weight): the
    matrix product runs under shard_map, split on N like a column-parallel weight's outputs, or on K like a
    row-parallel weight's inputs, the partial products then summed. The matrix views split where their leading
    logical axis does (heads of [heads, head_dim], ...); a weight splits on K or on N, never both. Zeros split
    like the scales."""
    axes = weight.values.get_metadata()["axes"]
    axes = axes[len(axes) - weight.values[...].ndim:]  # one layer's slice inside the layer scan: no "layers"
    k_axis, n_axis = axes[0], axes[weight.contract]
    scales = P(n_axis) if schemes.parse(weight.scheme).group is None else P(k_axis, n_axis)
    in_specs = (P(None, k_axis), P(k_axis, n_axis), scales, scales)[:num_operands]
    return shard_map_logical(matmul, in_specs=in_specs, out_specs=P(None, n_axis), sum_over=(k_axis,))


def check_matrix_spec(spec: str, contract: int) -> None:
    """A quantized weight multiplies as a matrix: x's last `contract` dims against the weight's first ones."""
    inputs, out = spec.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    lhs, out = lhs.removeprefix("..."), out.removeprefix("...")
    if rhs[:contract] != lhs[len(lhs) - contract:] or out != lhs[:len(lhs) - contract] + rhs[contract:]:
        raise ValueError(f"quantized dense needs x[..., K dims] @ w[K dims, N dims]; {spec!r} with {contract} "
                         f"contraction dims is not of that form")
