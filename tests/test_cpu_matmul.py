"""The CPU weight-streaming matmul (jaxserve/cpu/matmul.cc, C++ through XLA's FFI) against the einsum, and the
engine with matmul=cpu against matmul=xla."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import cpu
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.llm import LLM
from jaxserve.estimate import abstract_runner
from jaxserve.kv.cache import AttentionMetadata, KVCache
from jaxserve.models.kernels import Kernels, resolve_matmul
from jaxserve.models.llama import DecoderLayers, Llama, kept_in_storage, pack_weights, random_model
from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or cpu.compiler() is None,
                                reason="the CPU kernels need the CPU backend and a C++ compiler")


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def random_weight(rng, dtype: str, layers: int, k: int, n: int):
    """(w [layers, K, N], scales [layers, N] for int8 else None)."""
    if dtype == "int8":
        return (jnp.asarray(rng.integers(-127, 128, (layers, k, n)), jnp.int8),
                jnp.asarray(rng.random((layers, n)) * 0.01 + 1e-3, jnp.float32))
    return jnp.asarray(rng.standard_normal((layers, k, n)), dtype), None


def reference(x, w, scales, layer):
    ref = jnp.einsum("mk,kn->mn", x, w[layer].astype(jnp.float32), precision="highest")
    return ref if scales is None else ref * scales[layer]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("m,k,n", [(1, 768, 2048), (2, 5, 7), (3, 130, 300), (5, 768, 768), (9, 200, 1030),
                                   (17, 100, 2050), (32, 64, 257), (64, 96, 200),  # streaming and register-blocked
                                   (65, 40, 24), (97, 1000, 70), (131, 800, 1100), (200, 384, 512)])  # cache-blocked
def test_matches_the_einsum(rng, dtype, m, k, n):
    layers = 3
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w, scales = random_weight(rng, dtype, layers, k, n)
    for layer in range(layers):
        ref = reference(x, w, scales, layer)
        out = jax.jit(lambda x, w, s, i: cpu.matmul(x, w, i, s))(x, w, scales, jnp.int32(layer))
        assert out.shape == (m, n) and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("m,k,n", [(1, 768, 2048), (2, 130, 64), (1, 300, 128), (5, 768, 768), (17, 100, 192),
                                   (64, 96, 128), (65, 40, 128), (200, 384, 512), (70, 1600, 192),  # 3 bands of K
                                   (9, 300, 64), (30, 1000, 64),  # one panel, K split over the threads
                                   (1, 131, 64), (3, 131, 128), (6, 201, 64)])  # Streams: K not in four equal parts
def test_packed_weights_match_the_einsum(rng, dtype, m, k, n):
    """A packed weight [L, N / 64, K, 64] on every path (one row with K split over the threads, register-blocked,
    cache-blocked), against the einsum of the weight it was packed from; unpack gives that weight back."""
    layers = 2
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w, scales = random_weight(rng, dtype, layers, k, n)
    assert cpu.packable(w)
    packed = cpu.pack(w)
    assert packed.shape == (layers, n // 64, k, 64) and packed.dtype == w.dtype
    assert (cpu.unpack(packed) == w).all()
    for layer in range(layers):
        ref = reference(x, w, scales, layer)
        out = jax.jit(lambda x, w, s, i: cpu.matmul(x, w, i, s, m - 1 if m > 2 else None))(x, packed, scales, layer)
        real = m - 1 if m > 2 else m
        np.testing.assert_allclose(np.asarray(out)[:real], np.asarray(ref)[:real], rtol=1e-5,
                                   atol=1e-4 * float(jnp.abs(ref).max()))
        assert not np.asarray(out)[real:].any()
    assert not cpu.packable(jnp.zeros((1, 8, 100))) and not cpu.packable(jnp.zeros((8, 128)))


@pytest.mark.parametrize("m,rows", [(1, 1), (2, 2), (5, 4), (16, 16), (40, 3), (100, 70)])
def test_several_weights_in_one_call(rng, m, rows):
    """matmuls: each weight its own dtype, layout and width (one the threads split along K), one call, each output
    its own product; the padding rows zeros in every output."""
    k, layer = 160, 1  # two K splits of 80 rows for a weight of one column block
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    weights = [random_weight(rng, "float32", 2, k, 200), random_weight(rng, "int8", 2, k, 64),
               random_weight(rng, "bfloat16", 2, k, 130), random_weight(rng, "int8", 2, k, 128)]
    given = [(w, s) for w, s in weights[:3]] + [(cpu.pack(weights[3][0]), weights[3][1])]
    outs = jax.jit(lambda x, ws: cpu.matmuls(x, ws, layer, rows))(x, given)
    assert len(outs) == len(weights)
    for out, (w, scales) in zip(outs, weights, strict=True):
        ref = np.asarray(reference(x, w, scales, layer))
        assert out.shape == (m, w.shape[2])
        np.testing.assert_allclose(np.asarray(out)[:rows], ref[:rows], rtol=1e-5, atol=1e-4 * float(np.abs(ref).max()))
        assert not np.asarray(out)[rows:].any()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("m,rows", [(40, 3), (40, 1), (200, 70), (200, 0), (16, 99)])
def test_multiplies_only_the_real_rows(rng, dtype, m, rows):
    """The leading `rows` rows are x's products, the padding's are zeros (whatever x holds there); more rows
    than M means all of them."""
    k, n = 96, 130
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    if dtype == "int8":
        w, scales = jnp.asarray(rng.integers(-127, 128, (2, k, n)), jnp.int8), jnp.full((2, n), 0.01, jnp.float32)
    else:
        w, scales = jnp.asarray(rng.standard_normal((2, k, n)), jnp.float32), None
    ref = jnp.einsum("mk,kn->mn", x, w[1].astype(jnp.float32), precision="highest") * (1 if scales is None else 0.01)
    out = np.asarray(jax.jit(lambda x, w, s, r: cpu.matmul(x, w, 1, s, r))(x, w, scales, jnp.int32(rows)))
    real = min(rows, m)
    np.testing.assert_allclose(out[:real], np.asarray(ref)[:real], rtol=1e-5, atol=1e-4 * float(jnp.abs(ref).max()))
    assert not out[real:].any()


def test_bfloat16_rows_and_an_unstacked_weight(rng):
    x = jnp.asarray(rng.standard_normal((1, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 40)), jnp.float32)
    ref = jnp.einsum("mk,kn->mn", x.astype(jnp.float32), w, precision="highest")
    np.testing.assert_allclose(np.asarray(cpu.matmul(x, w, 0)), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_refuses_what_it_cannot_do(rng):
    w = jnp.zeros((1, 8, 8), jnp.int8)
    with pytest.raises(ValueError, match="scales"):
        cpu.matmul(jnp.zeros((1, 8)), w, 0)


def test_resolution():
    assert resolve_matmul("auto") == "cpu"
    assert resolve_matmul("auto", tensor_parallel_size=2) == "xla"  # an FFI call cannot be split by GSPMD
    with pytest.raises(ValueError, match="one device"):
        resolve_matmul("cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="auto, pallas, cpu or xla"):
        resolve_matmul("onednn")
    kernels = Kernels.resolve("xla", "cpu")
    for dtype in ("float32", "bfloat16", "int8"):  # every weight type it reads
        assert kernels.reads_stacked(dtype)
    assert not kernels.reads_stacked("float16")
    assert not Kernels.resolve("xla", "xla").reads_stacked("float32")


# The engines below compile one decode bucket and two prompt buckets instead of the default ladders: decode steps
# of 1-4 rows and prompt steps of up to 16 tokens take the streaming and register-blocked paths, the 128-token
# bucket (more than 64 rows) the cache-blocked one, so every kernel path runs with fewer compiles.
FEW_SHAPES = dict(decode_buckets=(4,), prefill_token_buckets=(16, 128), xla_optimization_level=0)

TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.mark.parametrize("quantization", [None, pytest.param("int8", marks=pytest.mark.slow),  # ~45 s each on a
                                          pytest.param("int4", marks=pytest.mark.slow)])  # 2-core CPU: make test-slow
def test_engine_generates_what_xla_does(quantization):
    """Greedy, one sequence and four at once, same tokens; the long prompt's steps take the cache-blocked path."""
    cfg = dataclasses.replace(TINY, quantization=quantization)
    prompts = [[5, 9, 13, 40, 2], [7, 7, 8], [100, 101, 102, 103], [3], [(7 * i) % 290 + 3 for i in range(90)]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for matmul in ("cpu", "xla"):
        engine = LLMEngine(random_model(cfg, jnp.float32, seed=3),
                           EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128, matmul=matmul,
                                        **FEW_SHAPES), show_progress=False)
        assert engine.core.kernels.matmul_name == matmul
        llm = LLM(engine=engine, show_progress=False)
        alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        outputs[matmul] = (alone, batch)
    assert outputs["cpu"] == outputs["xla"]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_every_step_reads_weights_in_place(quantization):
    """Decode and prompt steps alike: every projection goes through the kernel (q, k and v in one call, gate and up
    in another), and the LM head too (float32, unquantized in both models), so no weight slice is copied out and no
    XLA dot is left; with matmul=xla there are XLA dots (what this test looks for is there to find: checked once, on the float model).
    The steps are lowered by the runner such an engine builds (estimate.abstract_runner), not compiled."""
    cfg = dataclasses.replace(TINY, quantization=quantization)
    texts = {}
    for matmul in ("cpu", "xla") if quantization is None else ("cpu",):
        config = EngineConfig(max_num_seqs=128, max_num_batched_tokens=128, max_model_len=64, matmul=matmul,
                              decode_buckets=(1, 128), prefill_token_buckets=(16, 128), xla_optimization_level=0)
        runner = abstract_runner(cfg, config, "float32")
        texts[matmul] = {shape: runner._lower_step(shape).as_text() for shape in runner.buckets.shapes()}
    assert {(shape.kind, shape.tokens) for shape in texts["cpu"]} >= {("decode", 1), ("decode", 128),
                                                                      ("prefill", 16), ("prefill", 128)}
    for shape, text in texts["cpu"].items():  # q|k|v o gate|up down in the scan body + the LM head (a prompt
        assert text.count(cpu.MATMUL_TARGET) >= 5, shape  # step has a second one for prompt logprobs)
        assert "stablehlo.dot_general" not in text, shape
    for shape, text in texts.get("xla", {}).items():
        assert cpu.MATMUL_TARGET not in text and "stablehlo.dot_general" in text, shape


def test_the_last_layer_multiplies_only_the_wanted_rows():
    """A prompt step needs the final hidden state only where logits are taken: given `wanted`, the model gathers
    those tokens to the front after the last layer's attention and multiplies only them through its output
    projection and MLP. Their hidden states are the full pass's, every layer's K and V are written alike, and the
    rows past them were not run through the last MLP. Only the in-place kernel prunes."""
    model = random_model(dataclasses.replace(TINY, num_layers=2), jnp.float32, seed=3)
    kernels = Kernels.resolve("xla", "cpu")
    assert model.prunes_rows(kernels) and not model.prunes_rows(Kernels.resolve("xla", "xla"))
    page_size, num_tokens = 8, 32
    query_lens = [5, 17, 3]  # three prompts, then padding
    query_start = jnp.asarray(np.cumsum([0] + query_lens), jnp.int32)
    tables = jnp.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]], jnp.int32)
    meta = AttentionMetadata.build(tables, jnp.asarray(query_lens + [0], jnp.int32),
                                   jnp.concatenate([query_start, query_start[-1:]]), num_tokens, page_size)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 300, num_tokens), jnp.int32)
    cache = KVCache.zeros(2, TINY.num_kv_heads, 10, page_size, TINY.head_dim, jnp.float32)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, wanted):
        decoder: Llama = nnx.merge(graphdef, state)
        return decoder(tokens, cache, meta, kernels, wanted=wanted)

    last = query_start[1:] - 1  # [4, 21, 24]
    order = jnp.zeros(num_tokens, jnp.int32).at[:3].set(last)
    full, full_cache = forward(state, None)
    pruned, pruned_cache = forward(state, (order, jnp.int32(3)))
    np.testing.assert_allclose(pruned[:3], full[last], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(full_cache), jax.tree.leaves(pruned_cache), strict=True):
        np.testing.assert_array_equal(a, b)
    # the rows past the wanted ones skipped the last layer's products: token 0's state is not the full pass's
    assert not np.allclose(pruned[3:], full[0], atol=1e-3)
    with pytest.raises(ValueError, match="prunes rows"):
        nnx.merge(graphdef, state)(tokens, cache, meta, Kernels.resolve("xla", "xla"), wanted=(order, jnp.int32(3)))


# every projection's and the LM head's output dims are whole 64-column panels: the engine packs them all
PANELS = dataclasses.replace(TINY, vocab_size=320, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                             head_dim=32)


def test_an_engine_packs_the_weights_of_a_model_it_owns_only():
    """Given a model it owns (as from_model_dir's), the engine stores what the kernel reads packed, where the output
    dims are whole panels, and frees the originals; a model the caller keeps is used as it is."""
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, matmul="cpu",
                          **FEW_SHAPES)
    model = random_model(TINY, jnp.float32, seed=3)
    wq = np.asarray(model.layers.wq[...])
    kept = LLMEngine(model, config, show_progress=False).core.runner.params["layers"]
    assert not any(kept[name].get_metadata().get("packed") for name in ("wq", "wk", "w_down"))
    assert not model.layers.wq[...].is_deleted()
    layers = LLMEngine(model, config, show_progress=False, owns_model=True).core.runner.params["layers"]
    assert layers["wq"].get_metadata()["packed"] == ((64,), (4, 16))  # [layers, N / 64, K, 64]
    assert layers["wq"][...].shape == (3, 1, 64, 64)
    np.testing.assert_array_equal(np.asarray(cpu.unpack(layers["wq"][...])), wq.reshape(3, 64, 64))
    assert "packed" not in layers["wk"].get_metadata()  # 2 x 16 outputs: not whole panels
    assert model.layers.wq[...].is_deleted() and not model.layers.wk[...].is_deleted()  # taken over
    other = random_model(TINY, jnp.float32, seed=3)
    assert pack_weights(other, Kernels.resolve("xla", "xla")) is other  # no layout to pack for


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_packed_engine_generates_what_xla_does(quantization):
    """Every weight packed (PANELS), float32 and int8: greedy tokens as with matmul=xla, decode and prompt steps."""
    cfg = dataclasses.replace(PANELS, quantization=quantization)
    prompts = [[5, 9, 13, 40, 2], [7, 7, 8], [(7 * i) % 300 + 3 for i in range(80)]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for matmul in ("cpu", "xla"):
        engine = LLMEngine(random_model(cfg, jnp.float32, seed=5),
                           EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128, matmul=matmul,
                                        **FEW_SHAPES), show_progress=False, owns_model=True)
        weights = jax.tree.leaves(engine.core.runner.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        packed = [w for w in weights if w.get_metadata().get("packed")]
        assert len(packed) == (8 if matmul == "cpu" else 0)  # 7 projections and the LM head
        llm = LLM(engine=engine, show_progress=False)
        outputs[matmul] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs["cpu"] == outputs["xla"]


def test_a_bfloat16_checkpoint_keeps_the_weights_the_kernel_reads_in_bfloat16(converted):
    """Served in float32 with matmul=cpu, a bfloat16 checkpoint's projections and LM head stay bfloat16 (the kernel
    multiplies them in float32: the same products from half the bytes); the rest is float32. The greedy tokens are
    matmul=xla's (which upcasts every weight), the logged and metered weight bytes are the arrays' own."""
    model_dir = converted("llama3.1", "bfloat16")
    prompts = [[5, 9, 13, 40, 2], [(7 * i) % 200 + 3 for i in range(80)]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for matmul in ("cpu", "xla"):
        engine = LLMEngine.from_model_dir(model_dir, EngineConfig(
            max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128, matmul=matmul, dtype="float32",
            compilation_cache_dir="", **FEW_SHAPES), show_progress=False)
        core = engine.core
        params_ = core.runner.params
        kept = {f"layers/{name}" for name in DecoderLayers.PROJECTIONS} | (
            set() if core.model_config.tie_word_embeddings else {"lm_head"})
        if matmul == "cpu":
            assert core.stored_dtypes == dict.fromkeys(kept, "bfloat16")
            assert all(params_["layers"][name][...].dtype == jnp.bfloat16 for name in DecoderLayers.PROJECTIONS)
            assert core.weights_description == "float32 (projections stored bfloat16)"
        else:
            assert core.stored_dtypes == {} and params_["layers"]["wq"][...].dtype == jnp.float32
        assert params_["embed"][...].dtype == jnp.float32 and params_["final_norm"][...].dtype == jnp.float32
        arrays = jax.tree.leaves(params_, is_leaf=lambda x: isinstance(x, nnx.Variable))
        assert core.weight_bytes == sum(w[...].nbytes for w in arrays)
        outputs[matmul] = [o.outputs[0].token_ids for o in LLM(engine=engine, show_progress=False).generate(
            prompts, params)]
    assert outputs["cpu"] == outputs["xla"]


@pytest.mark.parametrize("case", ["float32 checkpoint", "bfloat16 compute", "xla kernels", "int8"])
def test_weights_stay_in_the_run_dtype_unless_the_kernel_reads_them_in_float32(case):
    cfg = dataclasses.replace(PANELS, dtype="float32" if case == "float32 checkpoint" else "bfloat16",
                              quantization="int8" if case == "int8" else None)
    kernels = Kernels.resolve("xla", "xla" if case == "xla kernels" else "cpu")
    dtype = "bfloat16" if case == "bfloat16 compute" else "float32"
    kept = kept_in_storage(cfg, dtype, kernels)
    assert kept == (("lm_head",) if case == "int8" else ())  # int8 projections are int8 whatever the dtype
