"""validate_request: the one place a request's ranges, token ids and lengths are checked (no model, no jax)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import (CONTEXT_LENGTH_EXCEEDED, SAMPLING_RANGES, InvalidRequestError, Range,
                                 RequestLimits, validate_request)

LIMITS = RequestLimits(vocab_size=100, max_model_len=32)


def error_of(prompt, params: SamplingParams, limits: RequestLimits = LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as error:
        validate_request(prompt, params, limits)
    return error.value


def test_a_valid_request_passes():
    validate_request([1, 2, 3], SamplingParams(max_tokens=29, temperature=0.0, logit_bias={5: -100.0},
                                               stop_token_ids=(99,), logprobs=20, stop=["\n"]), LIMITS)
    validate_request([1] * 31, SamplingParams(max_tokens=None), LIMITS)


@pytest.mark.parametrize("field, value, words", [
    ("n", 0, "n must be in [1, 128], got 0"),
    ("max_tokens", 0, "max_tokens must be in [1, 2147483647]"),
    ("max_tokens", 2**31, "max_tokens must be in [1, 2147483647]"),
    ("min_tokens", -1, "min_tokens must be in [0, 2147483647]"),
    ("min_tokens", 2**31, "min_tokens must be in [0, 2147483647]"),
    ("temperature", 100.5, "temperature must be in [0, 100], got 100.5"),
    ("temperature", float("nan"), "temperature must be in [0, 100]"),
    ("temperature", "hot", "temperature must be in [0, 100]"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0"),
    ("top_k", -2, "top_k must be in [-1, 2147483647]"),
    ("top_k", 2**31, "top_k must be in [-1, 2147483647], got 2147483648"),  # killed the engine (np.int32)
    ("n", 1.5, "n must be an integer, got 1.5"),
    ("top_k", 2.0, "top_k must be an integer"),
    ("temperature", None, "temperature must be in [0, 100], got None"),
    ("temperature", float("inf"), "temperature must be in [0, 100]"),
    ("ignore_eos", "yes", "ignore_eos must be true or false"),
    ("skip_special_tokens", None, "skip_special_tokens must be true or false"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 10]"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("seed", -1, "seed must be in [0, 9223372036854775807]"),
    ("logprobs", 21, "logprobs must be in [0, 20]"),
    ("prompt_logprobs", -1, "prompt_logprobs must be in [0, 20]"),
])
def test_every_range_names_its_field(field, value, words):
    error = error_of([1], SamplingParams(**{field: value}))
    assert error.param == field and words in str(error) and error.code is None


@pytest.mark.parametrize("params, param, words", [
    (SamplingParams(min_tokens=5, max_tokens=4), "min_tokens", "must not exceed max_tokens"),
    (SamplingParams(stop=["a", ""]), "stop", "non-empty"),
    (SamplingParams(stop=["a"] * 17), "stop", "at most 16"),
    (SamplingParams(logit_bias={i: 1.0 for i in range(301)}), "logit_bias", "at most 300"),
    (SamplingParams(logit_bias={1: 101.0}), "logit_bias", "[-100, 100]"),
    (SamplingParams(logit_bias={100: 1.0}), "logit_bias", "token id 100, outside the vocabulary [0, 100)"),
    (SamplingParams(stop_token_ids=(3, -1)), "stop_token_ids", "token id -1"),
    (SamplingParams(stop_token_ids=tuple(range(17))), "stop_token_ids", "at most 16"),
    (SamplingParams(stop=["x" * 513]), "stop", "at most 512 characters"),
    (SamplingParams(stop=["ok", "a\ud800"]), "stop", "not valid Unicode"),
])
def test_stops_and_biases(params, param, words):
    error = error_of([1], params)
    assert error.param == param and words in str(error)


def test_prompt_token_ids_and_lengths():
    assert error_of([], SamplingParams()).param == "prompt"
    bad_id = error_of([1, 100], SamplingParams())
    assert bad_id.param == "prompt" and "token id 100" in str(bad_id) and bad_id.code is None
    too_long = error_of([1] * 32, SamplingParams(max_tokens=None))
    assert too_long.param == "prompt" and too_long.code == CONTEXT_LENGTH_EXCEEDED
    assert str(too_long) == "prompt has 32 tokens; max_model_len 32 leaves no room to generate"
    no_room = error_of([1] * 20, SamplingParams(max_tokens=13))
    assert no_room.param == "max_tokens" and no_room.code == CONTEXT_LENGTH_EXCEEDED
    assert str(no_room) == "prompt (20 tokens) + max_tokens (13) exceeds max_model_len 32"


def test_min_tokens_is_bounded_by_the_context_when_max_tokens_is_absent():
    """Chat without max_tokens: min_tokens must fit in what max_model_len leaves (2**31 killed the engine)."""
    for min_tokens in (30, 2**31 - 1):
        error = error_of([1] * 3, SamplingParams(max_tokens=None, min_tokens=min_tokens))
        assert error.param == "min_tokens" and error.code == CONTEXT_LENGTH_EXCEEDED
    assert "exceeds the 29 tokens max_model_len 32 leaves after the prompt (3 tokens)" in str(error)
    validate_request([1] * 3, SamplingParams(max_tokens=None, min_tokens=29), LIMITS)


def test_text_with_a_lone_surrogate_is_refused_where_it_enters():
    from jaxserve.engine.engine import tokenize

    class Tokenizer:
        def encode(self, text):
            return [ord(c) for c in text]

    with pytest.raises(InvalidRequestError) as error:
        tokenize(Tokenizer(), "hi \ud800 there")
    assert error.value.param == "prompt" and "(U+D800) at character 3" in str(error.value)
    with pytest.raises(InvalidRequestError, match="prompt must be text or a sequence of integer token ids"):
        tokenize(Tokenizer(), [1, 2.5])
    assert tokenize(Tokenizer(), "ok") == ("ok", (111, 107))


def test_renamed_speaks_the_requests_field_names():
    error = error_of([1] * 20, SamplingParams(max_tokens=13))
    chat = error.renamed({"prompt": "messages", "max_tokens": "max_completion_tokens"})
    assert chat.param == "max_completion_tokens" and chat.code == CONTEXT_LENGTH_EXCEEDED
    assert str(chat) == "messages (20 tokens) + max_completion_tokens (13) exceeds max_model_len 32"
    batch = error_of([1] * 40, SamplingParams()).renamed({"prompt": "prompt[2]"})
    assert batch.param == "prompt[2]" and str(batch).startswith("prompt[2] has 40 tokens")
    assert isinstance(batch, ValueError)


def test_errors_survive_pickling():  # replicas and multi-host pass them between processes
    error = pickle.loads(pickle.dumps(error_of([1] * 40, SamplingParams())))
    assert (error.param, error.code, str(error)) == ("prompt", CONTEXT_LENGTH_EXCEEDED,
                                                     "prompt has 40 tokens; max_model_len 32 leaves no room to generate")


def test_ranges_describe_and_bound_the_same_interval():
    assert Range(0, 1, low_open=True).bounds() == {"gt": 0, "le": 1}
    assert Range(-1).bounds() == {"ge": -1} and Range(-1).describe() == "must be >= -1"
    for name, allowed in SAMPLING_RANGES.items():
        assert hasattr(SamplingParams(), name), name
        assert not allowed.contains(True)  # a JSON true is not 1


def test_validation_imports_no_jax():
    code = "import sys, jaxserve.validation, jaxserve.sampling_params; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
