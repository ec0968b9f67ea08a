"""The per-request adapter argument of the offline API, shaped like vLLM's LoRARequest. No jax."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """`LLM.generate(..., lora_request=LoRARequest("sql", 1, "/adapters/sql"))`: the adapter is read from
    `lora_path` the first time its name is seen and kept by name afterwards. `lora_int_id` is accepted for vLLM
    compatibility; jaxserve keys adapters by name (and gives each load its own internal id)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None  # accepted for vLLM compatibility; the base check compares shapes

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
