"""Pallas GPU kernels (Triton-style) for jaxserve; each module keeps a pure-jnp reference beside its kernel."""
