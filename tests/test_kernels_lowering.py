"""CUDA cross-lowering of every kernel on a CPU-only machine, for an abstract NVIDIA H200.

Interpret mode accepts code that the Triton lowering rejects (non-power-of-2 tensors, mixed dot dtypes, fewer
than 16 dot rows, scalar prefetch, unsupported primitives). Lowering with `lowering_platforms=("cuda",)` under an
AbstractMesh whose AbstractDevice is an H200 runs the real Pallas->Triton lowering; each Triton module is then
re-parsed and run through the MLIR verifier. Triton's own compiler passes (layouts, pipelining, shared-memory
and register budgets, PTX) run inside XLA at GPU compile time; where the `triton` package is installed (3.6 is
on the GPU image), test_triton_compiles_for_sm90 pushes the same Triton IR through it for sm_90 with no GPU.
bench/gpu_check.sh runs the kernel tests compiled on a real GPU.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as triton_lowering
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import paged_attention as pa
from pallas_kernels import ragged_paged_attention as rpa

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

TRITON_TARGET = "__gpu$xla.gpu.triton"
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
LAYERS, PAGES = 4, 2048  # pool of a realistic size: 2**31-byte offsets must not overflow


def lower_for_h200(fn, *avals):
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H200)):
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))


def _custom_calls(op):
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                if child.operation.name == "stablehlo.custom_call":
                    yield child.operation
                yield from _custom_calls(child.operation)


def triton_calls(lowered) -> list[dict]:
    """The Triton kernels in a lowered computation: launch parameters, operand types, verified module."""
    calls = []
    for op in _custom_calls(lowered.compiler_ir("stablehlo").operation):
        if ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_TARGET:
            continue
        config = op.attributes["mhlo.backend_config"]
        with triton_lowering._new_ir_context():
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            assert module.operation.verify(), "the Triton module fails MLIR verification"
            text = str(module)
        calls.append(dict(triton_ir=module.operation.get_asm(), num_warps=ir.IntegerAttr(config["num_warps"]).value,
                          num_stages=ir.IntegerAttr(config["num_stages"]).value,
                          operand_types=[str(v.type) for v in op.operands], module=text))
    return calls


def _pool(kv_heads, page_size, head_dim, dtype):
    return jax.ShapeDtypeStruct((LAYERS, kv_heads, PAGES, page_size, head_dim), dtype)


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _check_one_kernel(lowered, pool):
    [call] = triton_calls(lowered)
    pool_type = f"tensor<{'x'.join(map(str, pool.shape))}x{ir_dtype(pool.dtype)}>"
    assert call["operand_types"].count(pool_type) == 2, "K and V pools must reach the kernel whole (no copies)"
    assert "tt.dot" in call["module"]
    assert "inputPrecision = tf32" not in call["module"], "float32 dots must not silently run in TF32"
    return call


def ir_dtype(dtype) -> str:
    return {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}[jnp.dtype(dtype).name]


# (batch, max_context, group, head_dim, page_size, dtype, window): the benchmark shapes plus the test ranges.
DECODE_SHAPES = [
    (1, 8192, 4, 128, 16, jnp.bfloat16, None),
    (64, 2048, 4, 128, 16, jnp.bfloat16, None),
    (256, 8192, 4, 128, 32, jnp.bfloat16, 4096),
    (8, 1024, 1, 64, 64, jnp.float32, None),
    (16, 512, 8, 64, 16, jnp.float16, 100),
    (3, 333, 3, 128, 16, jnp.float32, None),
]


@pytest.mark.parametrize("batch,context,group,head_dim,page_size,dtype,window", DECODE_SHAPES)
def test_decode_lowers_for_h200(batch, context, group, head_dim, page_size, dtype, window):
    kv_heads = 8
    pool = _pool(kv_heads, page_size, head_dim, dtype)
    fn = functools.partial(pa.paged_attention, scale=head_dim ** -0.5, sliding_window=window)
    lowered = lower_for_h200(fn, jax.ShapeDtypeStruct((batch, kv_heads * group, head_dim), dtype), pool, pool,
                             _i32(), _i32(batch, -(-context // page_size)), _i32(batch))
    call = _check_one_kernel(lowered, pool)
    config = pa.choose_decode_config(batch, kv_heads, head_dim, jnp.dtype(dtype).itemsize, context)
    assert (call["num_warps"], call["num_stages"]) == (config.num_warps, config.num_stages)


# (tokens, seqs, group, head_dim, page_size, dtype, window, config)
RAGGED_SHAPES = [
    (2048, 4, 4, 128, 16, jnp.bfloat16, None, None),  # prefill chunks
    (512, 64, 4, 128, 16, jnp.bfloat16, None, None),  # mixed: a few chunks and many decode tokens
    (256, 256, 8, 128, 32, jnp.bfloat16, 1024, None),  # decode-like
    (32, 8, 4, 128, 16, jnp.bfloat16, None, None),  # verify (speculative decoding): 8 sequences x (K = 3) + 1
    (320, 64, 4, 128, 16, jnp.bfloat16, None, None),  # verify: 64 x (4 + 1), short query blocks
    (128, 8, 1, 64, 64, jnp.float32, None, None),
    (96, 5, 3, 64, 16, jnp.float16, 40, rpa.RaggedConfig(block_q=4, block_k=16)),
]


@pytest.mark.parametrize("tokens,seqs,group,head_dim,page_size,dtype,window,config", RAGGED_SHAPES)
def test_ragged_lowers_for_h200(tokens, seqs, group, head_dim, page_size, dtype, window, config):
    kv_heads = 8
    pool = _pool(kv_heads, page_size, head_dim, dtype)
    fn = functools.partial(rpa.ragged_paged_attention, scale=head_dim ** -0.5, sliding_window=window,
                           config=config)
    lowered = lower_for_h200(fn, jax.ShapeDtypeStruct((tokens, kv_heads * group, head_dim), dtype), pool, pool,
                             _i32(), _i32(seqs, 64), _i32(seqs), _i32(seqs + 1))
    _check_one_kernel(lowered, pool)


def test_kernels_inside_a_layer_scan_read_the_stacked_cache():
    """The model scans over layers with the cache as a carry: each kernel must index its layer in place."""
    pool = _pool(8, 16, 128, jnp.bfloat16)
    q = jax.ShapeDtypeStruct((32, 32, 128), jnp.bfloat16)

    def step(q, ck, cv, tables, lens, query_start):
        def layer_body(carry, layer):
            x = pa.paged_attention(carry, ck, cv, layer, tables, lens, scale=0.1)
            x = rpa.ragged_paged_attention(x, ck, cv, layer, tables, lens, query_start, scale=0.1)
            return x, None
        return jax.lax.scan(layer_body, q, jnp.arange(LAYERS))[0]

    lowered = lower_for_h200(step, q, pool, pool, _i32(32, 16), _i32(32), _i32(33))
    calls = triton_calls(lowered)
    assert len(calls) == 2
    pool_type = "tensor<4x8x2048x16x128xbf16>"
    assert all(c["operand_types"].count(pool_type) == 2 for c in calls)


def test_lowering_rejects_what_interpret_mode_accepts():
    """The harness is live: a 48-key tile runs in interpret mode but the Triton lowering refuses it."""
    pool = _pool(2, 16, 64, jnp.float32)
    fn = functools.partial(pa._decode_call, scale=0.1, interpret=False, config=pa.DecodeConfig(block_k=48))
    qg = jax.ShapeDtypeStruct((2, 2, 16, 64), jnp.float32)
    with pytest.raises(Exception, match="power of 2"):
        lower_for_h200(fn, qg, pool, pool, _i32(1), _i32(1), _i32(2, 8), _i32(2))


def test_gemma_variants_lower_inside_a_layer_scan():
    """Gemma: soft-capped scores (tanh in the kernel) and a per-layer window read from the scan (an operand)."""
    pool = _pool(8, 16, 256, jnp.bfloat16)
    q = jax.ShapeDtypeStruct((32, 16, 256), jnp.bfloat16)
    windows = jnp.asarray([4096, 0, 4096, 0], jnp.int32)  # sliding and global layers alternate

    def step(q, ck, cv, tables, lens, query_start):
        def layer_body(carry, layer):
            kw = dict(scale=256 ** -0.5, sliding_window=windows[layer], softcap=50.0)
            x = pa.paged_attention(carry, ck, cv, layer, tables, lens, **kw)
            x = rpa.ragged_paged_attention(x, ck, cv, layer, tables, lens, query_start, **kw)
            return x, None
        return jax.lax.scan(layer_body, q, jnp.arange(LAYERS))[0]

    lowered = lower_for_h200(step, q, pool, pool, _i32(32, 16), _i32(32), _i32(33))
    calls = triton_calls(lowered)
    assert len(calls) == 2
    assert all("tanh" in c["module"] for c in calls), "the soft-cap's tanh is missing from a kernel"


def test_wrappers_refuse_tiles_the_triton_dot_cannot_take():
    pool = jnp.zeros((1, 1, 4, 16, 64), jnp.float32)
    q, i32 = jnp.zeros((4, 3, 64), jnp.float32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="query rows"):  # 2 tokens x 4 padded heads = 8 rows
        rpa.ragged_paged_attention(q, pool, pool, 0, jnp.zeros((1, 4), jnp.int32), i32[:1], i32, scale=1.0,
                                   config=rpa.RaggedConfig(block_q=2))
    with pytest.raises(ValueError, match="block_k"):
        pa.paged_attention(q, pool, pool, 0, jnp.zeros((4, 4), jnp.int32), jnp.zeros((4,), jnp.int32), scale=1.0,
                           config=pa.DecodeConfig(block_k=8))


SM90_SHARED_MEMORY = 232448  # bytes one block may use on H100/H200 (227 KiB)
SM90_KERNELS = {  # name -> (kernel, tokens or batch, sequences, dtype)
    "decode_bf16": ("decode", 64, 64, jnp.bfloat16),
    "decode_f32": ("decode", 4, 4, jnp.float32),
    "prefill_bf16": ("ragged", 2048, 4, jnp.bfloat16),
    "mixed_bf16": ("ragged", 256, 256, jnp.bfloat16),
}


def _lower_bench_kernel(kind, rows, seqs, dtype):
    pool = _pool(8, 16, 128, dtype)
    q = jax.ShapeDtypeStruct((rows, 32, 128), dtype)
    if kind == "decode":
        return lower_for_h200(functools.partial(pa.paged_attention, scale=0.1), q, pool, pool, _i32(),
                              _i32(seqs, 128), _i32(seqs))
    return lower_for_h200(functools.partial(rpa.ragged_paged_attention, scale=0.1), q, pool, pool, _i32(),
                          _i32(seqs, 128), _i32(seqs), _i32(seqs + 1))


@pytest.mark.parametrize("name", SM90_KERNELS)
def test_triton_compiles_for_sm90(name, tmp_path):
    """Triton IR -> TTGIR -> PTX -> cubin for sm_90 with the `triton` package: pipelined loads, tensor-core dots
    for 16-bit inputs, IEEE float32 dots, shared memory within a block's limit, no register spills (16-bit)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    kind, rows, seqs, dtype = SM90_KERNELS[name]
    [call] = triton_calls(_lower_bench_kernel(kind, rows, seqs, dtype))
    source = tmp_path / f"{name}.ttir"
    source.write_text(call["triton_ir"])
    kernel = triton.compile(str(source), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=call["num_warps"], num_stages=call["num_stages"]))
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= SM90_SHARED_MEMORY
    assert "cp.async" in ptx, "K/V tile loads should be pipelined through shared memory"
    if dtype == jnp.float32:
        assert "tf32" not in ptx
        return
    assert "mma" in ptx, "16-bit dots should run on tensor cores"
    assert _ptxas_spill_bytes(Path(triton.__file__).parent, ptx, tmp_path) == 0


def _ptxas_spill_bytes(triton_dir: Path, ptx: str, tmp_path: Path) -> int:
    ptxas = triton_dir / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton ships no ptxas here")
    (tmp_path / "k.ptx").write_text(ptx)
    info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o",
                           str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", info))
