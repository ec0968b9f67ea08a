"""The offline API: `LLM(model_dir, **engine_options).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import os
from typing import Iterator, Sequence as Seq

from jaxserve.config import EngineConfig, sampling_defaults
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.replicas import build_engine
from jaxserve.lora import LoRARequest
from jaxserve.outputs import OutputKind, RequestOutput
from jaxserve.sampling_params import SamplingParams

Prompt = str | Seq[int]


class LLM:
    """A model loaded for offline generation. Engine options are EngineConfig fields (max_num_seqs=...,
    tensor_parallel_size=..., data_parallel_size=...: replicas behind one DataParallelCore; enable_lora=True,
    max_loras=..., max_lora_rank=...: LoRA adapters, picked per request with a LoRARequest)."""

    def __init__(self, model: str | os.PathLike | None = None, *,
                 engine: LLMEngine | None = None, show_progress: bool = True, **engine_options):
        if engine is None and model is None:
            raise ValueError("LLM needs a model directory")
        config = EngineConfig(**engine_options)
        defaults = sampling_defaults(model, config.generation_config) if model is not None else {}
        self._default_params = SamplingParams(**defaults)
        self.engine = engine if engine is not None else build_engine(model, config, show_progress=show_progress)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the model's generation_config.json defaults
        (with generation_config="auto"), else jaxserve's built-in ones, as vLLM's method of the same name."""
        return self._default_params

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order. `lora_request` (needs
        enable_lora=True): one adapter for every prompt, or one per prompt (None: the base model)."""
        finals: dict[str, RequestOutput] = {}
        request_ids = self._submit(prompts, sampling_params, OutputKind.FINAL_ONLY, lora_request)
        for output in self._drive():
            if output.finished:
                finals[output.request_id] = output
        return [finals[rid] for rid in request_ids]

    def generate_stream(self, prompts: Prompt | Seq[Prompt],
                        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
                        ) -> Iterator[RequestOutput]:
        """Yields each request's output every time it gains tokens; each output holds only what is new (its
        `text`, `token_ids` and `logprobs` are deltas: OutputKind.DELTA)."""
        self._submit(prompts, sampling_params, OutputKind.DELTA, lora_request)
        yield from self._drive()

    def _submit(self, prompts, sampling_params, kind: OutputKind, lora_request=None) -> list[str]:
        prompts = _as_prompt_list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        adapters = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} LoRA requests")
        request_ids = []
        for prompt, p, adapter in zip(prompts, params, adapters):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, p or self._default_params, kind=kind, lora_request=adapter)
            request_ids.append(request_id)
        return request_ids

    def _drive(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished_requests():
            yield from self.engine.step()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
