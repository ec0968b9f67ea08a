"""The device mesh, the logical-axis rules and shard_map over logical axes: the one module that names mesh axes.

    mesh       devices as a [data, model] grid; data-parallel replica i runs on row i (`replica_meshes`)

                         model ->
               data   | d0  d1  d2  d3 |   replica 0: tensor-parallel over d0..d3
                 |    | d4  d5  d6  d7 |   replica 1: tensor-parallel over d4..d7

    RULES      logical axis -> mesh axis (Megatron-style): q/k/v/gate/up are column-parallel (split on their
               output heads / kv_heads / mlp), o/down row-parallel (split on the same axes, as inputs), the
               embedding and the LM head vocab-parallel; the KV cache splits on kv_heads; MoE experts split
               across devices (expert parallelism; an expert's own mlp axis then stays whole, as a mesh axis
               is used once per array, first dimension first). Every other logical
               axis (embed, head_dim, layers, norm, pages, ...) is replicated.
    Sharder    RULES resolved for one model on one mesh: a logical axis stays replicated when some array's
               dimension of that axis does not divide by the mesh axis (e.g. 2 KV heads on 4 devices), so
               every placement is valid and GSPMD keeps the program correct whatever was split.
    shard_map_logical(fn, in_specs, out_specs)
               jax.shard_map with specs written in logical names, over the mesh set by `jax.set_mesh` while
               tracing (the engine compiles under its mesh); plain `fn` with no mesh or one device.

Models and kernels never see mesh axis names: they write `P(None, "kv_heads")` and this module maps it.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
MESH_AXES = (DATA, MODEL)
RULES: Mapping[str, str] = MappingProxyType({"vocab": MODEL, "heads": MODEL, "kv_heads": MODEL, "mlp": MODEL,
                                             "experts": MODEL})

LogicalAxes = Sequence[str | None]


class MeshError(ValueError):
    """A parallel layout the devices cannot hold; the message says what to change."""


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A [data, model] mesh over the first dp * tp devices (every process's, in multi-host runs)."""
    devices = list(jax.devices() if devices is None else devices)
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp < 1 or dp < 1:
        raise MeshError(f"tensor_parallel_size and data_parallel_size must be >= 1, not {tp} and {dp}")
    if tp * dp > len(devices):
        raise MeshError(f"tensor_parallel_size {tp} x data_parallel_size {dp} needs {tp * dp} devices; "
                        f"{len(devices)} are visible ({devices[0].platform})")
    return jax.make_mesh((dp, tp), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[:tp * dp])


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One [1, model] mesh per data-parallel replica (a row of `mesh`)."""
    return [Mesh(mesh.devices[i:i + 1], MESH_AXES, axis_types=mesh.axis_types)
            for i in range(mesh.shape[DATA])]


def tensor_parallel_size(mesh: Mesh) -> int:
    return mesh.shape[MODEL]


def _mesh_spec(axes: LogicalAxes, rules: Mapping[str, str]) -> PartitionSpec:
    """Logical names -> a PartitionSpec of mesh axes; a mesh axis is used once (the first dimension wins)."""
    used: set[str] = set()
    spec = []
    for name in axes:
        mesh_axis = rules.get(name) if name is not None else None
        spec.append(mesh_axis if mesh_axis not in used else None)
        used.add(mesh_axis)
    return PartitionSpec(*spec)


def divisible_rules(named_shapes: Iterable[tuple[LogicalAxes, tuple[int, ...]]], mesh_shape: Mapping[str, int],
                    rules: Mapping[str, str] = RULES) -> Mapping[str, str]:
    """`rules` for the logical axes the arrays have, without those some array cannot split evenly over their mesh
    axis (a dense model's rules name no `experts`)."""
    named_shapes = list(named_shapes)
    present = {name for axes, _ in named_shapes for name in axes}
    kept = {name: axis for name, axis in rules.items() if name in present}
    for axes, shape in named_shapes:
        for name, size in zip(axes, shape):
            if name in kept and size % mesh_shape[kept[name]]:
                del kept[name]
    return MappingProxyType(kept)


@dataclasses.dataclass(frozen=True)
class Sharder:
    """Where the arrays of one model go on one mesh. `sharding(axes)` is what the checkpoint loader and the
    engine place weights and the KV cache with."""

    mesh: Mesh
    rules: Mapping[str, str]  # resolved: only the logical axes that are split

    @classmethod
    def for_arrays(cls, mesh: Mesh, named_shapes: Iterable[tuple[LogicalAxes, tuple[int, ...]]]) -> "Sharder":
        """RULES, minus the logical axes that one of the (axes, shape) pairs cannot split evenly."""
        return cls(mesh, divisible_rules(named_shapes, mesh.shape))

    def spec(self, axes: LogicalAxes) -> PartitionSpec:
        return _mesh_spec(axes, self.rules)

    def sharding(self, axes: LogicalAxes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def shards(self, logical_axis: str) -> int:
        """How many pieces `logical_axis` is cut into (1: replicated)."""
        mesh_axis = self.rules.get(logical_axis)
        return self.mesh.shape[mesh_axis] if mesh_axis else 1

    @property
    def devices(self) -> list[jax.Device]:
        return list(self.mesh.devices.flat)

    def describe(self) -> str:
        split = ", ".join(f"{name}->{axis}" for name, axis in sorted(self.rules.items())) or "nothing split"
        return f"mesh {dict(self.mesh.shape)} ({split})"


def single_device_mesh(device: jax.Device | None = None) -> Mesh:
    return Mesh(np.array([device or jax.devices()[0]]).reshape(1, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def shard_map_logical(fn: Callable, in_specs, out_specs, sum_over: Sequence[str | None] = ()) -> Callable:
    """`jax.shard_map(fn)` over the mesh in context, with PartitionSpecs of logical names (a prefix tree of the
    arguments / outputs, like shard_map's). A logical axis that some argument cannot split evenly is replicated in
    every spec, so `fn` sees consistent local shapes (e.g. all heads when 2 KV heads meet 4 devices). `sum_over`:
    logical axes fn's outputs are partial sums over (a contraction split across devices), summed when split.
    Without a mesh in context, or on a one-device mesh, returns `fn` itself."""

    def mapped(*args):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or math.prod(mesh.axis_sizes) == 1:
            return fn(*args)
        rules = divisible_rules(_named_shapes(in_specs, args), dict(zip(mesh.axis_names, mesh.axis_sizes)))
        to_mesh = lambda tree: jax.tree.map(lambda spec: _mesh_spec(spec, rules), tree)  # noqa: E731
        summed = tuple(dict.fromkeys(rules[name] for name in sum_over if name in rules))  # each mesh axis once
        body = (lambda *a: jax.lax.psum(fn(*a), summed)) if summed else fn
        # check_vma=False: pallas_call out_shapes carry no varying-axes annotation (JAX asks for it otherwise)
        return jax.shard_map(body, mesh=mesh, in_specs=to_mesh(in_specs), out_specs=to_mesh(out_specs),
                             check_vma=False)(*args)

    return mapped


def _named_shapes(specs, args) -> list[tuple[LogicalAxes, tuple[int, ...]]]:
    pairs: list[tuple[LogicalAxes, tuple[int, ...]]] = []

    def collect(spec, subtree):
        pairs.extend((tuple(spec), leaf.shape) for leaf in jax.tree.leaves(subtree))

    jax.tree.map(collect, tuple(specs), tuple(args))
    return pairs
