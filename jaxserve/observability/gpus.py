"""Published specifications of the GPUs `jaxserve estimate --gpu` knows, one per name.

Figures are the vendor datasheets' (dense BF16 Tensor Core throughput: the datasheets print the sparse figure with
an asterisk, twice the dense one). Memory is the datasheet's "GB", which for HBM and GDDR parts is GiB; the
driver reserves a little of it (an "80GB" H100 reports 79.6 GiB), which the estimate's allocator fraction covers.
"""

from __future__ import annotations

import dataclasses
import re

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s, HBM/GDDR peak
    bf16_flops: float  # FLOP/s, dense BF16 Tensor Core peak
    device_kinds: tuple[str, ...]  # substrings of jax's device_kind that mean this part


GPUS = {spec.name: spec for spec in (
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/): SXM5 80 GB HBM3, 3.35 TB/s,
    # BF16 1,979 TFLOPS with sparsity; PCIe 80 GB HBM2e, 2 TB/s, 1,513 TFLOPS sparse; NVL 94 GB, 3.9 TB/s,
    # 1,671 TFLOPS sparse.
    GpuSpec("h100", 80 * GiB, 3.35e12, 989.5e12, ("H100 80GB HBM3", "H100 SXM")),
    GpuSpec("h100-pcie", 80 * GiB, 2.0e12, 756.5e12, ("H100 PCIe",)),
    GpuSpec("h100-nvl", 94 * GiB, 3.9e12, 835.5e12, ("H100 NVL",)),
    # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/): SXM 141 GB HBM3e, 4.8 TB/s,
    # BF16 1,979 TFLOPS sparse; NVL 141 GB, 4.8 TB/s, 1,671 TFLOPS sparse.
    GpuSpec("h200", 141 * GiB, 4.8e12, 989.5e12, ("H200",)),
    GpuSpec("h200-nvl", 141 * GiB, 4.8e12, 835.5e12, ("H200 NVL",)),
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100/): BF16 312 TFLOPS dense; 80 GB
    # HBM2e SXM 2,039 GB/s, 80 GB PCIe 1,935 GB/s; 40 GB HBM2 1,555 GB/s.
    GpuSpec("a100", 80 * GiB, 2.039e12, 312e12, ("A100-SXM4-80GB", "A100-SXM-80GB")),
    GpuSpec("a100-pcie", 80 * GiB, 1.935e12, 312e12, ("A100 80GB PCIe", "A100-PCIE-80GB")),
    GpuSpec("a100-40gb", 40 * GiB, 1.555e12, 312e12, ("A100-SXM4-40GB", "A100-PCIE-40GB")),
    # NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4/): 24 GB GDDR6, 300 GB/s,
    # BF16 242 TFLOPS sparse.
    GpuSpec("l4", 24 * GiB, 300e9, 121e12, ("L4",)),
    # NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s/): 48 GB GDDR6, 864 GB/s, BF16 362.05 TFLOPS
    # dense (733 sparse).
    GpuSpec("l40s", 48 * GiB, 864e9, 362.05e12, ("L40S",)),
    # NVIDIA A10 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/products/a10-gpu/): 24 GB GDDR6,
    # 600 GB/s, BF16 125 TFLOPS dense (250 sparse).
    GpuSpec("a10", 24 * GiB, 600e9, 125e12, ("A10",)),
)}


def gpu_for_device_kind(device_kind: str) -> GpuSpec | None:
    """The spec whose pattern is the longest whole-word match in jax's device_kind ("NVIDIA H100 80GB HBM3" ->
    h100; "A10" does not match "A100")."""
    matches = [(len(p), spec) for spec in GPUS.values() for p in spec.device_kinds
               if re.search(rf"(?<![A-Za-z0-9]){re.escape(p)}(?![A-Za-z0-9])", device_kind)]
    return max(matches, key=lambda m: m[0])[1] if matches else None
