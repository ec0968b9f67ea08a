"""The engine with attention=pallas (kernels in interpret mode on CPU) gives the XLA path's greedy tokens."""

import json

import pytest

from conftest import HF_FIXTURES
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

SMALL = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=16, max_model_len=128,
                     decode_buckets=(4,), prefill_token_buckets=(32,), prefill_seq_buckets=(4,),
                     context_buckets=(128,), kv_cache_memory=2**22, xla_optimization_level=0,
                     compilation_cache_dir="")


@pytest.mark.parametrize("family", ["llama3.1", "mistral"])
def test_pallas_attention_matches_xla_greedy(converted, family):
    model_dir = converted(family)
    reference = json.loads((HF_FIXTURES / family / "reference.json").read_text())
    prompts = [p["ids"] for p in reference["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for impl in ("xla", "pallas"):
        engine = LLMEngine.from_model_dir(model_dir, SMALL.replace(attention=impl), show_progress=False)
        assert engine.core.kernels.attention_name == impl
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        finals = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()}
        tokens[impl] = [finals[str(i)] for i in range(len(prompts))]
    assert tokens["pallas"] == tokens["xla"]
    assert tokens["xla"] == [p["continuation"][:12] for p in reference["prompts"]]  # and both equal transformers
