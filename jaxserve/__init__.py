"""jaxserve: a JAX/XLA serving runtime for open-weight LLMs.

    from jaxserve import LLM, SamplingParams
    outputs = LLM("path/to/converted").generate(["Hello"], SamplingParams(max_tokens=32))
"""

__version__ = "0.1.0"

from jaxserve import host_memory as _host_memory

_host_memory.tune()  # before JAX starts its threads; see jaxserve/host_memory.py

_LAZY = {
    "LLM": "jaxserve.engine.llm",
    "LLMEngine": "jaxserve.engine.engine",
    "SamplingParams": "jaxserve.sampling_params",
    "StructuredOutputsParams": "jaxserve.structured.params",
    "EngineConfig": "jaxserve.config",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "LoRARequest": "jaxserve.lora.request",
}


def __getattr__(name):
    # Imported on first use so that `import jaxserve` (and the CLI's --help) does not start JAX.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")


__all__ = list(_LAZY) + ["__version__"]
