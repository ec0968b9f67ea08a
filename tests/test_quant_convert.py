"""`jaxserve convert --quantize`: what it writes, that loading needs no flag, and how close the fixtures stay.

The fixtures are tiny random models (weights ~ N(0, 0.02)); their logits are small sums of noise, so they say
little about accuracy: int8 stays within a stated bound of transformers' float32 logits, and both schemes must
compute exactly the model whose weights are the dequantized values. Accuracy on a trained model is
bench/quant_accuracy.py's job.
"""

from __future__ import annotations

import dataclasses
import functools
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import cli
from jaxserve.checkpoint import load_model, read_metadata
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.convert import ConvertError, convert
from jaxserve.convert.converter import config_from_source, read_params
from jaxserve.convert.hf_source import TensorReader, open_source
from jaxserve.convert.names import expected_tensors
from jaxserve.engine.engine import LLMEngine
from jaxserve.models.linear import QuantizedWeight
from jaxserve.models.llama import abstract_model
from jaxserve.quant import schemes
from jaxserve.quant.model import quantize_model
from jaxserve.sampling_params import SamplingParams
import test_parity as parity  # noqa: I001 (the paged single-sequence runner and transformers' logits)

FIXTURES = Path(__file__).parent / "fixtures"
# measured max |int8 - transformers float32| / max |logit| over the fixtures' prompts (prefill and greedy decode
# logits): llama2 0.037, llama3.1 0.029, llama3.2 0.067, mistral 0.031, qwen2 0.022, qwen3 0.042
INT8_FIXTURE_RTOL = 0.1


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized(family, scheme, lm_head=None) -> converted checkpoint dir, once per module."""
    root = tmp_path_factory.mktemp("quantized")
    done = {}

    def make(family, scheme, lm_head=None):
        key = (family, scheme, lm_head)
        if key not in done:
            done[key] = convert(FIXTURES / family / "hf", root / "-".join(map(str, key)), quantize=scheme,
                                quantize_lm_head=lm_head, progress=False)
        return done[key]

    return make


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_checkpoint_records_the_scheme_and_loads_without_a_flag(quantized, scheme):
    out = quantized("llama3.1", scheme, "int8")
    model_meta = read_metadata(out)["model"]
    assert (model_meta["quantization"], model_meta["lm_head_quantization"]) == (scheme, "int8")
    model = load_model(out, dtype="bfloat16")
    assert model.cfg.quantization == scheme
    assert isinstance(model.layers.w_down, QuantizedWeight) and isinstance(model.lm_head, QuantizedWeight)
    assert model.layers.w_down.values.dtype == (jnp.int8 if scheme == "int8" else jnp.uint8)
    assert model.layers.w_down.scales.dtype == jnp.float32  # scales keep float32 in a bfloat16 model
    assert model.embed.dtype == jnp.bfloat16 and model.layers.attn_norm.dtype == jnp.bfloat16


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_converting_quantized_equals_quantizing_the_float_conversion(quantized, converted, scheme):
    """Per-tensor quantization in the converter and whole-model quantize_model write identical arrays."""
    direct = nnx.to_pure_dict(nnx.state(load_model(quantized("qwen2", scheme)), nnx.Param))
    after = nnx.to_pure_dict(nnx.state(quantize_model(load_model(converted("qwen2")), scheme), nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, direct, after)


@pytest.mark.parametrize("family", ["llama2", "llama3.2", "qwen3"])
def test_int8_logits_stay_close_to_transformers(quantized, family):
    runner, ref = parity.paged_model(quantized(family, "int8")), parity.reference(family)
    for i, prompt in enumerate(ref.prompts):
        n = len(prompt["ids"])
        logits, _ = runner.prefill(prompt["ids"])
        parity.assert_close(logits, ref.float32(i)[:n], INT8_FIXTURE_RTOL, f"{family} prompt {i} int8 prefill")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_model_computes_the_model_of_its_dequantized_weights(quantized, scheme):
    """Through the paged prefill path: logits equal the float model whose weights are the dequantized values."""
    runner = parity.paged_model(quantized("mistral", scheme, "int8"))
    model = runner.model
    graphdef, state = nnx.split(dequantized(model))
    ref = parity.reference("mistral")
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t))
    for prompt in ref.prompts:
        logits, _ = runner.prefill(prompt["ids"])
        expected = np.asarray(forward(state, jnp.asarray([prompt["ids"]])))[0]
        parity.assert_close(logits, expected, parity.FLOAT32_RTOL, f"{scheme} vs dequantized")


def dequantized(model):
    """The same model with every QuantizedWeight replaced by a float Param of its dequantized values."""
    cfg = dataclasses.replace(model.cfg, quantization=None, lm_head_quantization=None)
    graphdef, state = nnx.split(abstract_model(cfg, jnp.float32), nnx.Param)
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for name in list(values["layers"]):
        weight = getattr(model.layers, name)
        if isinstance(weight, QuantizedWeight):
            one_layer = functools.partial(schemes.dequantize, contract=weight.contract, scheme=weight.scheme)
            values["layers"][name] = jax.vmap(one_layer)(weight.values[...], weight.scales[...])
    if isinstance(getattr(model, "lm_head", None), QuantizedWeight):
        values["lm_head"] = model.lm_head.dequantize()
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def test_quantized_fixture_runs_in_the_engine_from_its_directory(quantized):
    out = quantized("llama3.1", "int4")
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, page_size=16, max_model_len=64,
                          decode_buckets=(2,), prefill_token_buckets=(32,), prefill_seq_buckets=(2,),
                          kv_cache_memory=2**20, kv_cache_dtype="int8", xla_optimization_level=0,
                          compilation_cache_dir="")
    engine = LLMEngine.from_model_dir(out, config, show_progress=False)
    assert engine.model_config.quantization == "int4"
    engine.add_request("a", "Hello there", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    [final] = engine.run_until_done()
    assert len(final.outputs[0].token_ids) == 5


def test_peak_memory_is_the_quantized_model_plus_a_few_tensors():
    source = open_source(FIXTURES / "llama2" / "hf")
    cfg = config_from_source(source, None, "int4")
    targets = expected_tensors(cfg)
    with TensorReader(source) as reader:
        largest = max(int(np.prod(reader.shape(name))) * 4 for name in targets)
        read_params(reader, targets, cfg, progress=False)  # compiles the per-tensor quantizer first
        tracemalloc.start()
        try:
            converted = read_params(reader, targets, cfg, progress=False)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    model_bytes = sum(a.nbytes for a in converted.values())
    assert "layers/wq/values" in converted and converted["layers/wq/values"].dtype == np.uint8
    assert peak <= model_bytes + 4 * largest, (peak, model_bytes, largest)


def test_cli_quantizes_and_a_jaxserve_checkpoint_can_be_quantized_again(tmp_path, converted, capsys):
    out = tmp_path / "q"
    assert cli.main(["convert", str(FIXTURES / "qwen3" / "hf"), str(out), "--quantize", "int8"]) == 0
    assert ModelConfig.load(out).quantization == "int8"
    requantized = tmp_path / "from-jaxserve"
    assert cli.main(["convert", str(converted("qwen3")), str(requantized), "--quantize", "int4"]) == 0
    assert ModelConfig.load(requantized).quantization == "int4"
    assert (requantized / "tokenizer.json").exists()
    capsys.readouterr()
    assert cli.main(["convert", str(requantized), str(tmp_path / "again"), "--quantize", "int8"]) == 1
    assert "already quantized" in capsys.readouterr().err


def test_a_tied_head_cannot_be_quantized(tmp_path):
    with pytest.raises(ConvertError, match="ties its LM head"):
        convert(FIXTURES / "llama3.2" / "hf", tmp_path / "out", quantize="int8", quantize_lm_head="int8",
                progress=False)
    assert not (tmp_path / "out").exists()


def test_a_float_jaxserve_checkpoint_needs_quantize(tmp_path, converted):
    with pytest.raises(ConvertError, match="pass --quantize"):
        convert(converted("qwen3"), tmp_path / "out", progress=False)
