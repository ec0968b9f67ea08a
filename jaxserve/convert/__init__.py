"""Hugging Face → jaxserve conversion: `convert(hf_dir, out_dir)`; the `jaxserve convert` command is `command`."""

from jaxserve.convert.converter import convert
from jaxserve.convert.hf_source import ConvertError

__all__ = ["convert", "ConvertError"]
