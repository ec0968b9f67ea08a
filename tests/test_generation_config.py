"""generation_config.json's sampling defaults (vLLM's --generation-config auto | vllm | FOLDER): which file is read,
and how a request's unset fields take them. The HTTP round trip is in test_server.py."""

from __future__ import annotations

import argparse
import json

import pytest

from jaxserve.cli_args import add_engine_flags, engine_config_from_args
from jaxserve.config import ConfigError, sampling_defaults
from jaxserve.server.chat import chat_params
from jaxserve.server.completions import completion_params
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request

GENERATION = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
              "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 64, "num_beams": 1}
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
            "max_tokens": 64}


def model_dir(tmp_path, generation=GENERATION, name="model"):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def test_auto_reads_the_models_file_and_vllm_ignores_it(tmp_path):
    directory = model_dir(tmp_path)
    assert sampling_defaults(directory) == sampling_defaults(directory, "auto") == DEFAULTS
    assert sampling_defaults(directory, "vllm") == {}
    assert sampling_defaults(tmp_path / "nothing-here") == {}  # no file: the built-in defaults


def test_a_folder_overrides_the_models_file(tmp_path):
    other = model_dir(tmp_path, {"temperature": 0.2}, name="other")
    assert sampling_defaults(model_dir(tmp_path), str(other)) == {"temperature": 0.2}
    with pytest.raises(ConfigError, match="no generation_config.json"):
        sampling_defaults(tmp_path / "model", str(tmp_path / "nowhere"))


def test_a_converted_checkpoint_without_the_file_uses_jaxserve_json(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "jaxserve.json").write_text(json.dumps({"format": 1, "generation": {"temperature": 0.3}}))
    assert sampling_defaults(directory) == {"temperature": 0.3}


def test_unusable_defaults_fail_at_start_up(tmp_path):
    with pytest.raises(ConfigError, match="temperature"):
        sampling_defaults(model_dir(tmp_path, {"temperature": -1.0}))


def test_the_flag_is_an_engine_option():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config_from_args(parser.parse_args([])).generation_config == "auto"
    assert engine_config_from_args(parser.parse_args(["--generation-config", "vllm"])).generation_config == "vllm"


def test_unset_request_fields_take_the_defaults_and_set_ones_keep_theirs():
    unset = completion_params(parse_request(CompletionRequest, {"prompt": "x", "temperature": None}), DEFAULTS)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty,
            unset.max_tokens) == (0.6, 0.9, 20, 0.05, 1.1, 64)
    given = completion_params(parse_request(CompletionRequest, {"prompt": "x", "temperature": 1.0, "top_k": 0,
                                                                "max_tokens": 5}), DEFAULTS)
    assert (given.temperature, given.top_k, given.max_tokens, given.top_p) == (1.0, 0, 5, 0.9)
    builtin = completion_params(parse_request(CompletionRequest, {"prompt": "x"}), {})
    assert (builtin.temperature, builtin.top_p, builtin.max_tokens) == (1.0, 1.0, 16)


def test_chat_max_completion_tokens_counts_as_setting_max_tokens():
    messages = [{"role": "user", "content": "hi"}]
    unset = chat_params(parse_request(ChatCompletionRequest, {"messages": messages}), DEFAULTS)
    assert (unset.temperature, unset.max_tokens) == (0.6, 64)
    given = chat_params(parse_request(ChatCompletionRequest, {"messages": messages, "max_completion_tokens": 7,
                                                              "temperature": 0}), DEFAULTS)
    assert (given.temperature, given.max_tokens) == (0.0, 7)
    assert chat_params(parse_request(ChatCompletionRequest, {"messages": messages}), {}).max_tokens is None
