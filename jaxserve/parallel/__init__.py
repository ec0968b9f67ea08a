"""Parallelism: the device mesh and logical-axis sharding rules (`sharding`), multi-host joining and step
messages (`multihost`). The only package that names mesh axes; see docs/parallel.md."""

from jaxserve.parallel.sharding import (RULES, MeshError, Sharder, make_mesh, replica_meshes, shard_map_logical,
                                        single_device_mesh, tensor_parallel_size)

__all__ = ["RULES", "MeshError", "Sharder", "make_mesh", "replica_meshes", "shard_map_logical",
           "single_device_mesh", "tensor_parallel_size"]
