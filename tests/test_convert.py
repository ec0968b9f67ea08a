"""`jaxserve convert`: what it writes, both config forms, sharded and bf16 sources, and every user error.

Broken Hugging Face directories are copies of the tiny fixtures (tests/fixtures/<family>/hf) with one thing changed.
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import cli
from jaxserve.checkpoint import load_model, model_params_numpy, read_metadata
from jaxserve.config import ModelConfig, model_config_from_hf, sampling_defaults
from jaxserve.convert import ConvertError, convert
from jaxserve.convert.converter import config_from_source, read_params
from jaxserve.convert.hf_source import TensorReader, open_source
from jaxserve.convert.names import expected_tensors

FIXTURES = Path(__file__).parent / "fixtures"
WEIGHTS = "model.safetensors"


def hf_copy(tmp_path: Path, family: str) -> Path:
    return Path(shutil.copytree(FIXTURES / family / "hf", tmp_path / f"{family}-hf"))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def edit_config(hf_dir: Path, **changes) -> dict:
    config = {**read_json(hf_dir / "config.json"), **changes}
    (hf_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return config


def edit_tensors(hf_dir: Path, change) -> None:
    tensors = load_file(hf_dir / WEIGHTS)
    change(tensors)
    save_file(tensors, hf_dir / WEIGHTS)


def convert_fails(hf_dir: Path, out_dir: Path, match: str, **kwargs) -> str:
    with pytest.raises(ConvertError, match=match) as info:
        convert(hf_dir, out_dir, progress=False, **kwargs)
    return str(info.value)


def params(model_dir: Path) -> dict:
    return model_params_numpy(load_model(model_dir))


def assert_same_params(a: dict, b: dict) -> None:
    flat_a, flat_b = _flatten(a), _flatten(b)
    assert flat_a.keys() == flat_b.keys()
    for name in flat_a:
        np.testing.assert_array_equal(flat_a[name], flat_b[name], err_msg=name)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}/") if isinstance(value, dict) else {prefix + key: value})
    return out


# ---------------------------------------------------------------------------------------------- what it writes

def test_jaxserve_json_holds_config_eos_ids_and_generation_defaults(tmp_path):
    hf = FIXTURES / "llama3.1" / "hf"
    out = convert(hf, tmp_path / "out", progress=False)
    meta = read_metadata(out)
    generation = read_json(hf / "generation_config.json")
    cfg = ModelConfig.load(out)
    assert cfg == model_config_from_hf(read_json(hf / "config.json"), generation)
    assert cfg.eos_token_ids == tuple(generation["eos_token_id"]) and len(cfg.eos_token_ids) == 3
    assert cfg.bos_token_id == generation["bos_token_id"]
    assert cfg.dtype == "float32"  # the old form's torch_dtype
    assert meta["generation"] == generation
    assert meta["hf_config"] == read_json(hf / "config.json")
    assert set(meta["tokenizer_files"]) == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                            "generation_config.json"}
    for name in meta["tokenizer_files"]:
        assert (out / name).read_bytes() == (hf / name).read_bytes()


def test_converted_checkpoint_keeps_the_sampling_defaults(tmp_path):
    """`serve --generation-config auto` finds generation_config.json's temperature/top_p in the checkpoint: the copied
    file, or jaxserve.json's "generation" where the file is gone."""
    hf = FIXTURES / "llama3.1" / "hf"
    out = convert(hf, tmp_path / "out", progress=False)
    assert sampling_defaults(out) == sampling_defaults(hf) == {"temperature": 0.6, "top_p": 0.9}
    (out / "generation_config.json").unlink()
    assert sampling_defaults(out) == {"temperature": 0.6, "top_p": 0.9}


def test_sentencepiece_tokenizer_and_chat_template_file_are_copied(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    (hf / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    out = convert(hf, tmp_path / "out", progress=False)
    assert (out / "tokenizer.model").read_bytes() == (hf / "tokenizer.model").read_bytes()
    assert (out / "chat_template.jinja").exists()
    assert ModelConfig.load(out).eos_token_ids == (2,)


@pytest.mark.parametrize("family, expected", [
    ("llama2", dict(rope_type="default", theta=10000.0, tie=False, qkv_bias=False, qk_norm=False, window=None)),
    ("mistral", dict(rope_type="default", theta=10000.0, tie=False, qkv_bias=False, qk_norm=False, window=16)),
    ("qwen2", dict(rope_type="default", theta=1e6, tie=False, qkv_bias=True, qk_norm=False, window=None)),
    ("qwen3", dict(rope_type="default", theta=1e6, tie=False, qkv_bias=False, qk_norm=True, window=None)),
    ("llama3.2", dict(rope_type="llama3", theta=5e5, tie=True, qkv_bias=False, qk_norm=False, window=None)),
])
def test_family_features_reach_the_config(tmp_path, family, expected):
    cfg = ModelConfig.load(convert(FIXTURES / family / "hf", tmp_path / "out", progress=False))
    assert (cfg.rope.type, cfg.rope.theta, cfg.tie_word_embeddings, cfg.qkv_bias, cfg.qk_norm, cfg.sliding_window) \
        == tuple(expected.values())
    if family == "qwen3":
        assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_heads


def to_old_rope_form(config: dict) -> dict:
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    return config


def to_new_rope_form(config: dict) -> dict:
    scaling = config.pop("rope_scaling") or {"rope_type": "default"}
    config["rope_parameters"] = {**scaling, "rope_theta": config.pop("rope_theta")}
    return config


@pytest.mark.parametrize("family, rewrite", [("llama3.1", to_new_rope_form), ("llama3.2", to_old_rope_form)])
def test_both_rope_config_forms_convert_to_the_same_config(tmp_path, family, rewrite):
    """llama3.1's fixture is written in the old top-level form, llama3.2's in the transformers-5 form."""
    original = convert(FIXTURES / family / "hf", tmp_path / "original", progress=False)
    hf = hf_copy(tmp_path, family)
    (hf / "config.json").write_text(json.dumps(rewrite(read_json(hf / "config.json"))))
    rewritten = convert(hf, tmp_path / "rewritten", progress=False)
    cfg = ModelConfig.load(original)
    assert ModelConfig.load(rewritten) == cfg
    assert cfg.rope.type == "llama3" and cfg.rope.factor in (8.0, 32.0)
    assert cfg.rope.original_max_position_embeddings == {"llama3.1": 8192, "llama3.2": 64}[family]


def test_legacy_rope_scaling_type_key(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    edit_config(hf, rope_scaling={"type": "linear", "factor": 2.0})
    cfg = ModelConfig.load(convert(hf, tmp_path / "out", progress=False))
    assert (cfg.rope.type, cfg.rope.factor) == ("linear", 2.0)


def test_sharded_checkpoint_with_index_converts_like_a_single_file(tmp_path):
    hf = hf_copy(tmp_path, "qwen2")
    tensors = load_file(hf / WEIGHTS)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, hf / shard)
    index = {"metadata": {"total_size": 0}, "weight_map": {n: s for s, ns in shards.items() for n in ns}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    (hf / WEIGHTS).unlink()
    sharded = convert(hf, tmp_path / "sharded", progress=False)
    single = convert(FIXTURES / "qwen2" / "hf", tmp_path / "single", progress=False)
    assert_same_params(params(sharded), params(single))


def test_bfloat16_source_and_dtype_choice(tmp_path):
    """A bf16 checkpoint converts to bf16 by default (config.json's dtype) and equals float32 weights rounded."""
    hf = hf_copy(tmp_path, "llama3.2")
    edit_config(hf, dtype="bfloat16")
    edit_tensors(hf, lambda t: t.update({n: a.astype(ml_dtypes.bfloat16) for n, a in t.items()}))
    from_bf16 = convert(hf, tmp_path / "from-bf16", progress=False)
    assert ModelConfig.load(from_bf16).dtype == "bfloat16"
    from_f32 = convert(FIXTURES / "llama3.2" / "hf", tmp_path / "from-f32", dtype="bfloat16", progress=False)
    assert ModelConfig.load(from_f32).dtype == "bfloat16"
    assert load_model(from_f32).dtype == ml_dtypes.bfloat16
    assert_same_params(params(from_bf16), params(from_f32))
    as_f32 = convert(hf, tmp_path / "as-f32", dtype="float32", progress=False)
    assert load_model(as_f32).dtype == np.float32


def test_peak_memory_is_one_model_copy_plus_a_few_tensors():
    """Streaming: the converted arrays are allocated once and filled tensor by tensor (numpy allocations are what
    tracemalloc sees; safetensors maps the files)."""
    source = open_source(FIXTURES / "llama2" / "hf")
    cfg = config_from_source(source, None)
    targets = expected_tensors(cfg)
    with TensorReader(source) as reader:
        largest = max(int(np.prod(reader.shape(name))) * 4 for name in targets)
        tracemalloc.start()
        try:
            converted = read_params(reader, targets, cfg, progress=False)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    model_bytes = sum(a.nbytes for a in converted.values())
    assert peak <= model_bytes + 4 * largest, (peak, model_bytes, largest)


def test_rotary_inv_freq_buffers_are_ignored(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    edit_tensors(hf, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    convert(hf, tmp_path / "out", progress=False)


def test_lm_head_in_a_tied_checkpoint_is_ignored(tmp_path):
    hf = hf_copy(tmp_path, "llama3.2")
    edit_tensors(hf, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    convert(hf, tmp_path / "out", progress=False)


# ---------------------------------------------------------------------------------------------- output directory

def test_non_empty_out_dir_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "tokenizer.model").write_text("stale, from an earlier conversion")
    message = convert_fails(FIXTURES / "llama3.1" / "hf", out, "not empty")
    assert "--force" in message
    convert(FIXTURES / "llama3.1" / "hf", out, force=True, progress=False)
    assert not (out / "tokenizer.model").exists(), "--force must not leave another model's tokenizer behind"
    assert (out / "notes.txt").read_text() == "mine", "--force removes only what a conversion writes"
    convert(FIXTURES / "qwen3" / "hf", out, force=True, progress=False)
    assert ModelConfig.load(out).family == "qwen3"


def test_out_dir_must_not_be_the_source_or_a_file(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    convert_fails(hf, hf, "Hugging Face directory itself", force=True)
    (tmp_path / "file").write_text("")
    convert_fails(hf, tmp_path / "file", "is a file")


@pytest.mark.parametrize("where", ["proc", "under a file"])
def test_unwritable_out_dir_fails_in_one_line_before_any_tensor_is_read(tmp_path, monkeypatch, where):
    hf = hf_copy(tmp_path, "llama2")
    monkeypatch.setattr("jaxserve.convert.converter.read_params",
                        lambda *a: pytest.fail("read tensors before checking that OUT_DIR can be written"))
    if where == "proc":
        message = convert_fails(hf, Path("/proc/jaxserve-convert-test/out"), "cannot write to OUT_DIR")
    else:
        (tmp_path / "file").write_text("")
        message = convert_fails(hf, tmp_path / "file" / "sub" / "out", "is a file, not a directory")
    assert "\n" not in message
    assert not (tmp_path / "file" / "sub").exists()


def test_config_without_architectures_is_read_by_its_model_type(tmp_path):
    """transformers' AutoModelForCausalLM picks the class from model_type when architectures is absent."""
    hf = hf_copy(tmp_path, "llama2")
    edit_config(hf, architectures=...)
    assert ModelConfig.load(convert(hf, tmp_path / "out", progress=False)).architecture == "LlamaForCausalLM"
    edit_config(hf, architectures=..., model_type="gpt2")
    convert_fails(hf, tmp_path / "out2", "'gpt2'")


# ---------------------------------------------------------------------------------------------- user errors

def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    edit_config(hf, architectures=["GPT2LMHeadModel"])
    message = convert_fails(hf, tmp_path / "out", "GPT2LMHeadModel")
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
                      "Qwen3MoeForCausalLM"):
        assert supported in message


def test_unsupported_rope_scaling_type(tmp_path):
    hf = hf_copy(tmp_path, "llama3.2")
    edit_config(hf, rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    message = convert_fails(hf, tmp_path / "out", "'mrope'")
    assert all(kind in message for kind in ("llama3", "linear", "yarn", "dynamic", "longrope"))


def test_missing_config_json(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    (hf / "config.json").unlink()
    convert_fails(hf, tmp_path / "out", "has no config.json")


def test_config_json_without_a_required_field(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    edit_config(hf, hidden_size=...)
    convert_fails(hf, tmp_path / "out", "no 'hidden_size'")


def test_invalid_config_json(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    (hf / "config.json").write_text("{")
    convert_fails(hf, tmp_path / "out", "not valid JSON")


def test_hf_dir_that_does_not_exist(tmp_path):
    convert_fails(tmp_path / "nowhere", tmp_path / "out", "is not a directory")


def test_no_safetensors(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    (hf / WEIGHTS).rename(hf / "pytorch_model.bin")
    message = convert_fails(hf, tmp_path / "out", r"no \*.safetensors")
    assert "pytorch_model.bin" in message


def test_corrupt_safetensors_file(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    (hf / WEIGHTS).write_bytes(b"<html>rate limited</html>")
    convert_fails(hf, tmp_path / "out", "not a readable safetensors file")


def test_missing_tokenizer(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    (hf / "tokenizer.model").unlink()
    (hf / "tokenizer.json").unlink()
    convert_fails(hf, tmp_path / "out", "no tokenizer")


def test_missing_shard_named_in_index(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    names = load_file(hf / WEIGHTS).keys()
    weight_map = {n: WEIGHTS for n in names} | {"model.norm.weight": "model-00002-of-00002.safetensors"}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    convert_fails(hf, tmp_path / "out", "model-00002-of-00002.safetensors")


def test_index_naming_a_tensor_no_shard_holds(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    weight_map = {n: WEIGHTS for n in load_file(hf / WEIGHTS)}
    edit_tensors(hf, lambda t: t.pop("model.norm.weight"))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    convert_fails(hf, tmp_path / "out", "model.norm.weight")


def test_tensor_with_the_wrong_shape_is_named(tmp_path):
    hf = hf_copy(tmp_path, "mistral")  # 2 kv heads of 16: k_proj is [32, 64]
    name = "model.layers.1.self_attn.k_proj.weight"
    edit_tensors(hf, lambda t: t.update({name: np.zeros((64, 64), np.float32)}))
    message = convert_fails(hf, tmp_path / "out", name)
    assert "[64, 64]" in message and "[32, 64]" in message and "num_key_value_heads=2" in message


def test_unexpected_tensor_is_named(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    name = "model.layers.0.self_attn.o_proj.bias"
    edit_tensors(hf, lambda t: t.update({name: np.zeros(64, np.float32)}))
    convert_fails(hf, tmp_path / "out", f"does not use: {name}")


def test_missing_tensor_is_named(tmp_path):
    hf = hf_copy(tmp_path, "qwen2")
    name = "model.layers.1.self_attn.v_proj.bias"
    edit_tensors(hf, lambda t: t.pop(name))
    convert_fails(hf, tmp_path / "out", f"lacks tensors this config.json needs: {name}")


def test_missing_lm_head_suggests_tied_embeddings(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    edit_tensors(hf, lambda t: t.pop("lm_head.weight"))
    convert_fails(hf, tmp_path / "out", "tie_word_embeddings")


def test_quantized_tensor_is_rejected(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    name = "model.layers.0.mlp.up_proj.weight"
    edit_tensors(hf, lambda t: t.update({name: t[name].astype(np.int8)}))
    convert_fails(hf, tmp_path / "out", f"{name} is stored as I8")


def test_failed_conversion_leaves_out_dir_untouched(tmp_path):
    hf = hf_copy(tmp_path, "llama2")
    edit_tensors(hf, lambda t: t.pop("model.norm.weight"))
    out = convert(FIXTURES / "llama2" / "hf", tmp_path / "out", progress=False)
    before = sorted(p.name for p in out.iterdir())
    convert_fails(hf, out, "model.norm.weight", force=True)
    assert sorted(p.name for p in out.iterdir()) == before


# ---------------------------------------------------------------------------------------------- the command

def test_cli_reports_user_errors_without_a_traceback(tmp_path, capsys):
    hf = hf_copy(tmp_path, "llama2")
    (hf / "tokenizer.model").unlink()
    (hf / "tokenizer.json").unlink()
    assert cli.main(["convert", str(hf), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "no tokenizer" in err and "Traceback" not in err


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cli_points_a_quantized_dtype_to_quantize(tmp_path, capsys, scheme):
    """`--dtype int8` is a guess a user makes (a benchmark harness made it): the error names the flag that does it."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["convert", str(FIXTURES / "qwen3" / "hf"), str(tmp_path / "out"), "--dtype", scheme])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--quantize {scheme}" in err and "bfloat16" in err and "float32" in err
    assert not (tmp_path / "out").exists()


def test_cli_names_the_storage_dtypes_for_any_other_dtype(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["convert", str(FIXTURES / "qwen3" / "hf"), str(tmp_path / "out"), "--dtype", "float64"])
    err = capsys.readouterr().err
    assert "'float64'" in err and "bfloat16" in err and "float32" in err


def test_the_commands_choices_are_the_converters():
    from jaxserve.convert import command, converter
    from jaxserve.quant.schemes import SCHEMES
    assert command.STORAGE_DTYPES == converter.OUTPUT_DTYPES and command.QUANTIZE_SCHEMES == SCHEMES


def test_cli_converts(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["convert", str(FIXTURES / "qwen3" / "hf"), str(out), "--dtype", "bfloat16"]) == 0
    assert ModelConfig.load(out).dtype == "bfloat16"
    assert str(out) in capsys.readouterr().out
    assert cli.main(["convert", str(FIXTURES / "qwen3" / "hf"), str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    assert cli.main(["convert", str(FIXTURES / "qwen3" / "hf"), str(out), "--force"]) == 0
    assert ModelConfig.load(out).dtype == "float32"
