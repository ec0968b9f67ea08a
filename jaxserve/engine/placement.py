"""Where an engine's device state lives: the weights split by their logical axes, the KV cache split on kv_heads,
the slot state (and every step input and output) replicated. Used once at start-up, on the engine's mesh
(jaxserve.parallel); a data-parallel replica passes its own row of the global mesh.

    weights     sharder.sharding(Param axes)        e.g. wq ("layers", "embed", "heads", "head_dim") -> heads split
    KV cache    sharder.sharding(CACHE_AXES)        k, v [layers, kv_heads, pages, page_size, head_dim]
    slots       replicated                          sampling state and token history, read by every device
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.engine.memory import free_device_memory
from jaxserve.kv.cache import CACHE_AXES, KVCache
from jaxserve.models.kernels import Kernels
from jaxserve.models.llama import Llama, abstract_model, kept_in_storage
from jaxserve.parallel import MeshError, Sharder, make_mesh
from jaxserve.parallel.multihost import agree_min


def engine_mesh(config: EngineConfig) -> Mesh:
    """The mesh of one engine: `tensor_parallel_size` devices. Data-parallel replicas each get a row of a larger
    mesh from jaxserve.engine.replicas."""
    if config.data_parallel_size > 1:
        raise ConfigError("data_parallel_size > 1 runs several engines: build them with "
                          "jaxserve.engine.replicas.build_engine (what `serve` and `generate` do)")
    tp = config.tensor_parallel_size
    if jax.process_count() > 1 and tp != jax.device_count():
        raise ConfigError(f"a multi-host run shards one model over every process's devices: set "
                          f"--tensor-parallel-size {jax.device_count()} (it is {tp})")
    try:
        return make_mesh(tp)
    except MeshError as exc:
        raise ConfigError(str(exc)) from None


def param_layout(cfg: ModelConfig, dtype) -> dict[str, tuple[tuple, tuple[int, ...]]]:
    """{"layers/wq": (logical axes, shape), ...} for every weight array of the model, quantized values and scales
    included ("layers/wq/values", "layers/wq/scales"). Nothing is allocated."""
    _, state = nnx.split(abstract_model(cfg, dtype), nnx.Param)
    return {"/".join(map(str, path)): (tuple(var.get_metadata()["axes"]), tuple(var.get_value().shape))
            for path, var in nnx.to_flat_state(state)}


def model_sharder(cfg: ModelConfig, mesh: Mesh, dtype) -> Sharder:
    """The sharding rules resolved for this model's weights and KV cache on `mesh`."""
    kv = (CACHE_AXES[:2], (cfg.num_layers, cfg.num_kv_heads))
    return Sharder.for_arrays(mesh, [*param_layout(cfg, dtype).values(), kv])


def place_model(model: Llama, sharder: Sharder) -> Llama:
    """A copy of the model with each weight on its sharding; `model` itself is left as it was (replicas may be
    built from one model). Weights the checkpoint loader restored into these shardings are not moved."""
    graphdef, state = nnx.split(model)

    def put(var: nnx.Variable) -> nnx.Variable:
        axes = var.get_metadata().get("axes", ())
        return var.replace(put_array(var.get_value(), sharder.sharding(axes)))

    return nnx.merge(graphdef, jax.tree.map(put, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def put_array(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """x on `sharding`. Across processes, each process supplies its own shards of a value it holds whole."""
    if getattr(x, "sharding", None) == sharding:
        return x
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def create_on_mesh(make: Callable, shardings_of: Callable):
    """make() evaluated straight into its shardings (shardings_of(abstract result)): no copy on one device first."""
    return jax.jit(make, out_shardings=shardings_of(jax.eval_shape(make)))()


def abstract_on_mesh(make: Callable, shardings_of: Callable):
    """What create_on_mesh(make, shardings_of) makes, as ShapeDtypeStructs with their shardings: nothing is
    allocated (executables compile against it before the real arrays exist)."""
    shapes = jax.eval_shape(make)
    shardings = shardings_of(shapes)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, shapes)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def kv_cache_shardings(kv: KVCache, sharder: Sharder) -> KVCache:
    """The cache's shardings (a KVCache of NamedShardings) for a cache or an abstract one."""
    return jax.tree.map(sharder.sharding, kv.logical_specs())


def free_memory(mesh: Mesh) -> int:
    """Free bytes on the fullest device of the mesh, agreed across processes (every host sizes the cache alike)."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return agree_min(min(free_device_memory(d) for d in local))


def kept_weights(cfg: ModelConfig, config: EngineConfig, dtype: str) -> tuple[str, ...]:
    """The weights an engine of `config` on this machine loads in the checkpoint's dtype (kept_in_storage): a
    bfloat16 checkpoint's projections when the CPU kernel multiplies them in float32; none when an adapter is merged
    into them (the sum would round)."""
    if config.merge_lora:
        return ()
    return kept_in_storage(cfg, dtype, Kernels.resolve(config.attention, config.matmul, None,
                                                       config.tensor_parallel_size))
