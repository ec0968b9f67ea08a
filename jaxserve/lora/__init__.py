"""LoRA adapters served beside one copy of the base weights, mixed in one batch.

    adapter.py   a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) read and checked
                 against the base model, as host arrays in jaxserve's weight layouts            (numpy, no jax)
    slots.py     which adapter sits in which device slot: LRU over refcounted slots             (no jax)
    registry.py  the adapters an engine knows by name, each with an id unique per load          (no jax)
    weights.py   the stacked device arrays [layers, max_loras + 1, ...] and the batched delta    (jax)

Slot 0 of the device arrays holds zeros and means "no adapter"; each token row of a step carries its slot. This
package's __init__ imports nothing, so the host side (scheduler) can use slots.py without jax.
"""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
