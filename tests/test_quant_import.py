"""Quantized checkpoints in: GPTQ, AWQ, compressed-tensors and FP8 (jaxserve.convert.quantized).

The checkpoints are the float fixtures with every decoder projection packed by tests/quant_formats.py, an
independent numpy implementation of each format's published layout. For each format:

- jaxserve's dequantized weights equal the format's own dequantization bit for bit, after casting jaxserve's
  float32 values to the format's dequantization dtype (float16 for GPTQ / AWQ, bfloat16 for compressed-tensors,
  float32 for HF FP8), the cast the jaxserve.quant.schemes docstring documents;
- the engine's greedy tokens equal those of the float model built from the dequantized weights, on the XLA
  matmul and on the Pallas kernels (interpret mode);
- bad input (a truncated qweight, a group size the tensors do not have, an unknown method) is one line of error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import quant_formats as qf
from jaxserve import cli
from jaxserve.checkpoint import load_model, read_metadata
from jaxserve.config import EngineConfig
from jaxserve.convert import ConvertError, convert
from jaxserve.convert.hf_source import HFSource, TensorReader
from jaxserve.convert.quantized import ImportedTensors, source_quantization
from jaxserve.engine.engine import LLMEngine
from jaxserve.estimate import load_model_config
from jaxserve.models.linear import QuantizedWeight
from jaxserve.models.llama import abstract_model
from jaxserve.quant import schemes
from jaxserve.quant.memory import weight_bytes
from jaxserve.sampling_params import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
HF_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
            "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def _gptq_config(bits=4, group=32, sym=True, desc_act=False, checkpoint_format="gptq", **extra):
    return {"quant_method": "gptq", "bits": bits, "group_size": -1 if group is None else group, "sym": sym,
            "desc_act": desc_act, "checkpoint_format": checkpoint_format, **extra}


def _compressed_config(bits=4, group=32, symmetric=True, layout="pack-quantized", weights=None, activations=None):
    weights = weights or {"num_bits": bits, "type": "int", "symmetric": symmetric,
                          "strategy": "channel" if group is None else "group", "group_size": group}
    return {"quant_method": "compressed-tensors", "format": layout, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "format": layout}}}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    packer: object
    config: dict | None
    scheme: str
    reference_dtype: object
    legacy_file: dict | None = None  # quantize_config.json instead of quantization_config
    lm_head: bool = False


def _rng_gptq(**kw):
    rng = np.random.default_rng(7)
    return lambda w: qf.gptq(w, rng=rng, **kw)


CASES = {c.name: c for c in [
    Case("gptq4_sym_g32", "llama3.1", _rng_gptq(bits=4, group=32), _gptq_config(), "int4-g32", np.float16),
    Case("gptq4_asym_g64_v2", "qwen2", _rng_gptq(bits=4, group=64, sym=False, v1=False),
         _gptq_config(group=64, sym=False, checkpoint_format="gptq_v2"), "int4-g64-zp", np.float16),
    Case("gptq4_asym_desc_act", "llama3.1", _rng_gptq(bits=4, group=32, sym=False, desc_act=True),
         _gptq_config(sym=False, desc_act=True), "int4-g32-zp-act", np.float16),
    Case("gptq4_channel_lm_head", "mistral", _rng_gptq(bits=4, group=None), _gptq_config(group=None, lm_head=True),
         "int4-ch", np.float16, lm_head=True),
    Case("gptq8_asym_g32", "llama3.1", _rng_gptq(bits=8, group=32, sym=False), _gptq_config(bits=8, sym=False),
         "int8-g32-zp", np.float16),
    Case("gptq4_quantize_config_json", "llama3.1", _rng_gptq(bits=4, group=64), None, "int4-g64", np.float16,
         legacy_file={"bits": 4, "group_size": 64, "desc_act": False, "sym": True}),
    Case("awq4_g32", "qwen2", lambda w: qf.awq(w, 32),
         {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
         "int4-g32-zp", np.float16),
    Case("ct_w4a16_sym_g32", "llama3.1", lambda w: qf.compressed_pack(w, 4, 32), _compressed_config(),
         "int4-g32", jnp.bfloat16),
    Case("ct_w4a16_asym_g64", "qwen2", lambda w: qf.compressed_pack(w, 4, 64, symmetric=False),
         _compressed_config(group=64, symmetric=False), "int4-g64-zp", jnp.bfloat16),
    Case("ct_w8a16_channel", "llama3.1", lambda w: qf.compressed_pack(w, 8, None), _compressed_config(8, None),
         "int8", jnp.bfloat16),
    Case("ct_fp8_channel", "llama3.1", qf.fp8_channel,
         _compressed_config(layout="float-quantized", weights={"num_bits": 8, "type": "float", "symmetric": True,
                                                               "strategy": "channel"},
                            activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
         "fp8", jnp.bfloat16),
    Case("fp8_blocks", "qwen2", qf.fp8_blocks,
         {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}, "fp8-g32",
         np.float32),
    Case("fp8_per_tensor", "llama3.1", qf.fp8_tensor, {"quant_method": "fp8", "activation_scheme": "static"},
         "fp8", np.float32),
]}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """imported(case) -> (jaxserve checkpoint dir, reference dequantized weights by HF prefix, HF dir)."""
    root = tmp_path_factory.mktemp("imported")
    done = {}

    def make(name):
        if name not in done:
            case = CASES[name]
            hf = root / f"{name}-hf"
            refs = qf.write_checkpoint(FIXTURES / case.family / "hf", hf, case.packer, case.config, case.legacy_file,
                                       lm_head=case.lm_head)
            done[name] = convert(hf, root / name, progress=False), refs, hf
        return done[name]

    return make


def _dequantized_layer(weight: QuantizedWeight, layer: int | None) -> np.ndarray:
    pick = (lambda p: None if p is None else p[...] if layer is None else p[...][layer])
    w = schemes.dequantize(pick(weight.values), pick(weight.scales), weight.contract, weight.scheme,
                           zeros=pick(weight.zeros), perm=pick(weight.perm))
    return np.asarray(w).reshape(-1, int(np.prod(w.shape[weight.contract:])))  # [K, N]


@pytest.mark.parametrize("name", CASES)
def test_dequantized_weights_equal_the_formats_own_dequantization(imported, name):
    case = CASES[name]
    out, refs, _ = imported(name)
    model = load_model(out)
    assert model.cfg.quantization == case.scheme
    assert model.cfg.lm_head_quantization == (case.scheme if case.lm_head else None)
    for layer in range(model.cfg.num_layers):
        for path, hf in HF_NAMES.items():
            ours = _dequantized_layer(getattr(model.layers, path), layer).T.astype(case.reference_dtype)
            np.testing.assert_array_equal(ours, refs[f"model.layers.{layer}.{hf}"], err_msg=f"{name} {hf}")
    if case.lm_head:
        np.testing.assert_array_equal(_dequantized_layer(model.lm_head, None).T.astype(case.reference_dtype),
                                      refs["lm_head"])
    elif not model.cfg.tie_word_embeddings:
        assert not isinstance(model.lm_head, QuantizedWeight)


ENGINE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=96,
                      decode_buckets=(4,), prefill_token_buckets=(32,), prefill_seq_buckets=(4,),
                      context_buckets=(96,), kv_cache_memory=2**20, xla_optimization_level=0,
                      compilation_cache_dir="")


def engine_greedy(model, matmul: str, prompts, new_tokens: int = 8) -> list[list[int]]:
    engine = LLMEngine(model, ENGINE.replace(matmul=matmul, attention="xla"), show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    finals = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()}
    return [finals[str(i)] for i in range(len(prompts))]


def float_model_of(model):
    """The float32 model whose weights are the quantized model's dequantized weights."""
    cfg = dataclasses.replace(model.cfg, quantization=None, lm_head_quantization=None)
    graphdef, state = nnx.split(abstract_model(cfg, jnp.float32), nnx.Param)
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for name in list(values["layers"]):
        weight = getattr(model.layers, name)
        if isinstance(weight, QuantizedWeight):
            values["layers"][name] = jnp.stack([weight_of_layer(weight, i) for i in range(cfg.num_layers)])
    if isinstance(getattr(model, "lm_head", None), QuantizedWeight):
        values["lm_head"] = model.lm_head.dequantize()
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def weight_of_layer(weight: QuantizedWeight, layer: int) -> jax.Array:
    pick = (lambda p: None if p is None else p[...][layer])
    return schemes.dequantize(pick(weight.values), pick(weight.scales), weight.contract, weight.scheme,
                              zeros=pick(weight.zeros), perm=pick(weight.perm))


def _prompts(vocab: int, count: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, vocab, int(n)).tolist() for n in (1, 13, 30)[:count]]


# One case per kernel variant in the default run (~50 s each on a loaded 2-core machine); the rest are `slow`.
@pytest.mark.parametrize("name", ["gptq4_asym_desc_act", "awq4_g32", "fp8_blocks", *[
    pytest.param(n, marks=pytest.mark.slow) for n in ("gptq8_asym_g32", "ct_w4a16_asym_g64", "ct_w8a16_channel",
                                                      "ct_fp8_channel", "gptq4_channel_lm_head")]])
def test_engine_greedy_tokens_equal_the_dequantized_float_model(imported, name):
    out, _, _ = imported(name)
    model = load_model(out, dtype="float32")
    prompts = _prompts(model.cfg.vocab_size)
    expected = engine_greedy(float_model_of(model), "xla", prompts)
    assert engine_greedy(model, "xla", prompts) == expected
    assert engine_greedy(model, "pallas", prompts[:2], new_tokens=4) == [t[:4] for t in expected[:2]]


def test_the_checkpoint_records_the_source_and_the_cli_says_what_it_imported(imported, tmp_path, capsys):
    _, _, hf = imported("fp8_per_tensor")
    assert cli.main(["convert", str(hf), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    source = "fp8 FP8 e4m3 (per-tensor or per-channel scales)"
    assert f"imported {source}, stored as fp8; FP8 activations dropped: runs them at 16 bits" in printed
    record = read_metadata(tmp_path / "out")["imported_quantization"]
    assert record == {"method": "fp8", "source": source, "scheme": "fp8", "dequantized": False,
                      "dropped": "FP8 activations"}


def test_dequantize_imports_the_float_weights_and_can_requantize(imported, tmp_path):
    out, refs, hf = imported("awq4_g32")
    float_dir = convert(hf, tmp_path / "float", dequantize=True, progress=False)
    model = load_model(float_dir, dtype="float32")
    assert model.cfg.quantization is None
    for layer in range(model.cfg.num_layers):
        ours = np.asarray(model.layers.w_down[...][layer]).reshape(-1, model.cfg.hidden_size).T
        np.testing.assert_array_equal(ours.astype(np.float16), refs[f"model.layers.{layer}.mlp.down_proj"])
    requantized = convert(hf, tmp_path / "int8", dequantize=True, quantize="int8", progress=False)
    assert load_model(requantized).cfg.quantization == "int8"
    with pytest.raises(ConvertError, match="already quantized .* --dequantize"):
        convert(hf, tmp_path / "refused", quantize="int8", progress=False)
    with pytest.raises(ConvertError, match="not a quantized checkpoint"):
        convert(FIXTURES / "qwen2" / "hf", tmp_path / "plain", dequantize=True, progress=False)


def test_memory_accounting_counts_each_formats_bytes(imported):
    for name in ("gptq4_asym_desc_act", "fp8_blocks", "gptq4_channel_lm_head"):
        out, _, hf = imported(name)
        model = load_model(out)
        stored = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert weight_bytes(model.cfg, model.cfg.dtype) == stored, name
        estimated = load_model_config(hf)  # `jaxserve estimate --model HF_DIR` sees the import's scheme
        assert (estimated.quantization, estimated.lm_head_quantization) == (model.cfg.quantization,
                                                                            model.cfg.lm_head_quantization)


# ---------------------------------------------------------------------------------------------- bad input

def _damaged(tmp_path, case_name, edit_tensors=None, edit_config=None) -> Path:
    case = CASES[case_name]
    hf = tmp_path / "hf"
    qf.write_checkpoint(FIXTURES / case.family / "hf", hf, case.packer, case.config, case.legacy_file)
    if edit_tensors:
        tensors = load_file(hf / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, hf / "model.safetensors")
    if edit_config:
        config = json.loads((hf / "config.json").read_text())
        edit_config(config["quantization_config"])
        (hf / "config.json").write_text(json.dumps(config))
    return hf


def _truncate_qweight(tensors):
    name = "model.layers.1.mlp.up_proj.qweight"
    tensors[name] = tensors[name][:-1]


BAD_INPUTS = {
    "truncated qweight": ("gptq4_sym_g32", _truncate_qweight, None,
                          r"tensor model.layers.1.mlp.up_proj.qweight has shape \[7, 128\], but a 4-bit GPTQ "
                          r"qweight .* is \[8, 128\] .* truncated"),
    "group size not the tensors'": ("gptq4_sym_g32", None, lambda c: c.update(group_size=64),
                                    r"qzeros has shape \[2, \d+\], but .* is \[1, \d+\]"),
    "unknown quant_method": ("gptq4_sym_g32", None, lambda c: c.update(quant_method="bitsandbytes"),
                             r"quant_method 'bitsandbytes' is not one jaxserve imports; supported: GPTQ"),
    "3-bit": ("gptq4_sym_g32", None, lambda c: c.update(bits=3), r"3-bit weights are not supported"),
    "marlin layout": ("gptq4_sym_g32", None, lambda c: c.update(checkpoint_format="marlin"),
                      r"checkpoint_format 'marlin' is a repacked kernel layout"),
    "W8A8 int": ("ct_w8a16_channel", None,
                 lambda c: c["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int"}),
                 r"8-bit integer activations \(W8A8\) need integer activation kernels"),
    "awq gemv": ("awq4_g32", None, lambda c: c.update(version="gemv"), r"AWQ version 'gemv'"),
    "sym with asymmetric zeros": ("gptq4_asym_g64_v2", None, lambda c: c.update(sym=True),
                                  r"says sym, but its zero points are not the symmetric ones"),
}


@pytest.mark.parametrize("what", BAD_INPUTS)
def test_bad_input_is_one_line_of_error(tmp_path, capsys, what):
    case_name, edit_tensors, edit_config, message = BAD_INPUTS[what]
    hf = _damaged(tmp_path, case_name, edit_tensors, edit_config)
    assert cli.main(["convert", str(hf), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxserve convert: error: ") and err.count("\n") == 1, err  # before any progress bar
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_decoder_projection_left_float_is_refused(tmp_path):
    def unquantize_one(tensors):
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            del tensors[f"model.layers.0.mlp.up_proj.{suffix}"]
        tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((128, 64), np.float32)

    hf = _damaged(tmp_path, "gptq4_sym_g32", unquantize_one)
    with pytest.raises(ConvertError, match=r"leaves model.layers.0.mlp.up_proj.weight unquantized.*--dequantize"):
        convert(hf, tmp_path / "out", progress=False)


# ---------------------------------------------------------------------------------------------- the formats' own code

OWN_CODE = Path(__file__).parent / "fixtures" / "quantized"  # written by tests/fixtures/make_quantized.py


@pytest.mark.parametrize("case", sorted(p.stem for p in OWN_CODE.glob("*.safetensors")))
def test_dequantization_equals_the_formats_own_code(case):
    """Linears quantized and packed by compressed-tensors itself, or packed from the published layout and
    dequantized by AutoAWQ's and transformers' own code: jaxserve reads the same weights, bit for bit."""
    meta = json.loads((OWN_CODE / f"{case}.json").read_text())
    with safe_open(OWN_CODE / f"{case}.safetensors", "numpy") as f:
        reference = f.get_tensor("reference")
    source = open_source_of(OWN_CODE / f"{case}.safetensors", meta["quantization_config"])
    with TensorReader(source) as reader:
        imported = ImportedTensors(reader, source_quantization(source),
                                   {"linear.weight": (meta["out_features"], meta["in_features"])})
        assert imported.is_quantized("linear.weight") and imported.names == {"linear.weight", "reference"}
        dequantized = imported.read("linear.weight")
    np.testing.assert_array_equal(dequantized.astype(reference.dtype), reference)


def open_source_of(shard: Path, quantization_config: dict) -> HFSource:
    return HFSource(shard.parent, {"quantization_config": quantization_config}, {}, (shard,), None)
