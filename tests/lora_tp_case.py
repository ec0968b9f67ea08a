"""LoRA under tensor parallelism, on 8 forced host devices, run in a subprocess by tests/test_lora.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/lora_tp_case.py

Prints one JSON object: greedy outputs of a batch mixing the base model and two adapters on 1 and on 4 devices,
and the mesh placement of the stacked adapter factors on 4 devices.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from lora_adapters import write_adapter  # noqa: E402
from parallel_cases import ENGINE, MODEL  # noqa: E402

from jaxserve.engine.engine import LLMEngine  # noqa: E402
from jaxserve.lora import LoRARequest  # noqa: E402
from jaxserve.models.llama import random_model  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 12, list(range(100, 119))]


def main() -> None:
    model = random_model(MODEL, jnp.float32, seed=0)
    nnx.update(model, jax.tree.map(lambda w: w * 8 if w.ndim >= 2 else w, nnx.state(model, nnx.Param)))
    root = Path(tempfile.mkdtemp())
    dirs = [write_adapter(root / "a", MODEL, rank=4, seed=1),
            write_adapter(root / "b", MODEL, rank=8, seed=2, modules=("q_proj", "o_proj", "down_proj"))]
    adapters = [None, LoRARequest("a", 1, str(dirs[0])), LoRARequest("b", 2, str(dirs[1])), None]
    result = {}
    for tp in (1, 4):
        engine = LLMEngine(model, ENGINE.replace(tensor_parallel_size=tp, enable_lora=True, max_loras=2,
                                                 max_lora_rank=8), show_progress=False)
        for i, (prompt, adapter) in enumerate(zip(PROMPTS, adapters)):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                               lora_request=adapter)
        finals = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run_until_done()}
        result[f"tp{tp}"] = [finals[str(i)] for i in range(len(PROMPTS))]
        lora = engine.core.runner.params["layers"]["lora"]
        result[f"specs{tp}"] = {name: [a if a is None else str(a) for a in lora[name][...].sharding.spec]
                                for name in ("wq_a", "wq_b", "wo_a", "wo_b", "w_down_a", "w_down_b")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
