"""Parity with PEFT itself: adapters made and run by PEFT on the tiny fixture models (tests/fixtures/lora, from
tests/fixtures/make_lora_reference.py: two families, two adapters each of different ranks and target sets, one
with rsLoRA) give jaxserve the same prompt logits (the base models' float32 tolerance) and, through the batched,
paged engine with both adapters in one batch beside a base request, the same greedy continuations."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import HF_FIXTURES
from jaxserve.checkpoint import load_model
from jaxserve.engine.llm import LLM
from jaxserve.lora import LoRARequest
from jaxserve.lora import weights as lora_weights
from jaxserve.lora.adapter import read_adapter
from jaxserve.sampling_params import SamplingParams
from test_parity import FLOAT32_RTOL, assert_close

LORA = HF_FIXTURES / "lora"
FAMILIES = ("llama3.1", "qwen2")
ADAPTERS = ("qv-r4", "all-r8")
MAX_RANK = 8


def reference(family: str, adapter: str) -> tuple[dict, np.lib.npyio.NpzFile]:
    directory = LORA / f"{family}-{adapter}"
    return json.loads((directory / "reference.json").read_text()), np.load(directory / "reference_logits.npz")


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_peft(converted, family):
    model = load_model(converted(family), dtype="float32")
    dense = lora_weights.attach(model, len(ADAPTERS), MAX_RANK)
    lora = dense.layers.lora
    factors = {k: getattr(lora, k)[...] for k in lora_weights.slot_values(None, model.cfg, MAX_RANK)}
    for slot, name in enumerate(ADAPTERS, start=1):
        adapter = read_adapter(LORA / f"{family}-{name}", model.cfg, MAX_RANK)
        factors = lora_weights.write_slot(factors, slot, lora_weights.slot_values(adapter, model.cfg, MAX_RANK))
    for k, v in factors.items():
        getattr(lora, k).set_value(v)
    forward = jax.jit(lambda tokens, slots: dense.forward_dense(tokens[None], lora_slots=slots[None])[0])
    for slot, name in enumerate(ADAPTERS, start=1):
        ref, logits = reference(family, name)
        for i, prompt in enumerate(ref["prompts"]):
            ids = np.asarray(prompt["ids"], np.int32)
            got = np.asarray(forward(ids, np.full(len(ids), slot, np.int32)))
            assert_close(got, logits[f"prompt{i}"], FLOAT32_RTOL, f"{family} {name} prompt {i}")


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_continuations_match_peft(converted, family):
    """Both adapters and the base model in one batch, through the paged engine: PEFT's greedy tokens."""
    llm = LLM(converted(family), enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK, max_model_len=128,
              max_num_seqs=8, max_num_batched_tokens=64, xla_optimization_level=0, show_progress=False)
    prompts, adapters, expected = [], [], []
    for i, name in enumerate(ADAPTERS):
        ref, _ = reference(family, name)
        request = LoRARequest(name, i + 1, str(LORA / f"{family}-{name}"))
        for prompt in ref["prompts"]:
            prompts.append(prompt["ids"])
            adapters.append(request)
            expected.append(prompt["continuation"])
    base = json.loads((HF_FIXTURES / family / "reference.json").read_text())["prompts"][1]
    prompts.append(base["ids"])
    adapters.append(None)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=adapters)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got[:-1] == expected
    assert got[-1] == base["continuation"][:16]  # the base request beside them is untouched
