"""Per-request sampling parameters (the offline API's and the server's common vocabulary)."""

from __future__ import annotations

import dataclasses

from jaxserve.structured.params import StructuredOutputsParams
from jaxserve.validation import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS  # noqa: F401 (the device arrays' widths)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuation. Defaults follow vLLM; the allowed ranges are
    jaxserve.validation.SAMPLING_RANGES, checked by `validate_request` where a request enters the engine.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters. `logprobs` is the
    number of top alternatives returned per sampled token (0: only the sampled token's own logprob; None: none).
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar (jaxserve.structured).
    """

    n: int = 1
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        # Accept the natural Python spellings (a string, lists, a dict) and store hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in bias))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
