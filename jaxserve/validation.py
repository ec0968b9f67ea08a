"""Placeholder until the validation branch lands (see branch `requests`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxserve.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int


def validate_request(prompt_token_ids: Sequence[int], params: SamplingParams, limits: RequestLimits) -> None:
    try:
        params.validate(limits.vocab_size)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), str(exc).split()[0]) from None
    if any(not 0 <= t < limits.vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {limits.vocab_size})", "prompt")
    n, limit = len(prompt_token_ids), limits.max_model_len
    if n < 1:
        raise InvalidRequestError("prompt must contain at least one token", "prompt")
    if n >= limit:
        raise InvalidRequestError(f"prompt has {n} tokens; max_model_len {limit} leaves no room to generate", "prompt")
    if params.max_tokens is not None and n + params.max_tokens > limit:
        raise InvalidRequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                                  f"{limit}", "max_tokens")
