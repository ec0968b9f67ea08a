"""`jaxserve convert HF_DIR OUT_DIR`: import a Hugging Face checkpoint into jaxserve's format."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", metavar="HF_DIR",
                        help="Hugging Face model folder: config.json, *.safetensors, tokenizer files (or a float "
                             "jaxserve checkpoint, to write a --quantize'd copy of it)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the jaxserve checkpoint (new or empty)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="dtype to store the weights in (default: config.json's; float16 becomes bfloat16)")
    parser.add_argument("--quantize", choices=("int8", "int4"), default=None,
                        help="store the decoder layers' projections weight-only quantized: int8 (per-output-channel "
                             "scales) or int4 (groups of 128 along the input dim); embeddings and norms stay float")
    parser.add_argument("--quantize-lm-head", choices=("int8", "int4"), default=None,
                        help="also quantize an untied LM head (default: keep it in --dtype)")
    parser.add_argument("--force", action="store_true",
                        help="replace the jaxserve checkpoint in a non-empty OUT_DIR")


def run(args: argparse.Namespace) -> int:
    from jaxserve.convert import ConvertError, convert
    from jaxserve.logs import configure_logging
    configure_logging("info")  # progress: a bar on a terminal, a line every few seconds elsewhere
    try:
        out = convert(args.hf_dir, args.out_dir, dtype=args.dtype, force=args.force, quantize=args.quantize,
                      quantize_lm_head=args.quantize_lm_head)
    except ConvertError as e:
        print(f"jaxserve convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
