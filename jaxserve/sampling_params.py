"""Per-request sampling parameters (the offline API's and the server's common vocabulary)."""

from __future__ import annotations

import dataclasses

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuation. Defaults follow vLLM; `validate()` names the bad field.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters. `logprobs` is the
    number of top alternatives returned per sampled token (0: only the sampled token's own logprob; None: none).
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

    def __post_init__(self):
        # Accept the natural Python spellings (a string, lists, a dict) and store hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the offending parameter."""
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must not exceed max_tokens"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"must be in [0, {MAX_TOP_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"must be in [0, {MAX_TOP_LOGPROBS}]"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS, f"may hold at most {MAX_LOGIT_BIAS} entries"),
            ("logit_bias", all(-100.0 <= v <= 100.0 for _, v in self.logit_bias), "values must be in [-100, 100]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be a non-negative integer"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        if vocab_size is not None:
            checks.append(("logit_bias", all(0 <= k < vocab_size for k, _ in self.logit_bias),
                           f"token ids must be in [0, {vocab_size})"))
            checks.append(("stop_token_ids", all(0 <= t < vocab_size for t in self.stop_token_ids),
                           f"token ids must be in [0, {vocab_size})"))
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"{name} {message}")
