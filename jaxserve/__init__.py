"""jaxserve: a JAX/XLA serving runtime for open-weight LLMs."""

__version__ = "0.1.0"
