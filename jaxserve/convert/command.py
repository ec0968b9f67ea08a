"""`jaxserve convert HF_DIR OUT_DIR`: import a Hugging Face checkpoint into jaxserve's format."""

from __future__ import annotations

import argparse
import sys

# converter.OUTPUT_DTYPES and quant.schemes.SCHEMES, spelled out here so that parsing (and --help) imports no jax
STORAGE_DTYPES = ("bfloat16", "float32")
QUANTIZE_SCHEMES = ("int8", "int4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", metavar="HF_DIR",
                        help="Hugging Face model folder: config.json, *.safetensors, tokenizer files (or a float "
                             "jaxserve checkpoint, to write a --quantize'd copy of it). GPTQ, AWQ, "
                             "compressed-tensors and FP8 checkpoints are imported in their own format")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the jaxserve checkpoint (new or empty)")
    parser.add_argument("--dtype", type=_storage_dtype, default=None, metavar="{%s}" % ",".join(STORAGE_DTYPES),
                        help="dtype to store the weights in (default: config.json's; float16 becomes bfloat16)")
    parser.add_argument("--quantize", choices=QUANTIZE_SCHEMES, default=None,
                        help="store the decoder layers' projections weight-only quantized: int8 (per-output-channel "
                             "scales) or int4 (groups of 128 along the input dim); embeddings and norms stay float")
    parser.add_argument("--quantize-lm-head", choices=QUANTIZE_SCHEMES, default=None,
                        help="also quantize an untied LM head (default: keep it in --dtype)")
    parser.add_argument("--dequantize", action="store_true",
                        help="read a quantized checkpoint (GPTQ, AWQ, compressed-tensors, FP8) as float: store its "
                             "dequantized weights in --dtype, or re-quantize them with --quantize (by default such a "
                             "checkpoint is imported in its own format, never dequantized)")
    parser.add_argument("--force", action="store_true",
                        help="replace the jaxserve checkpoint in a non-empty OUT_DIR")


def _storage_dtype(value: str) -> str:
    """--dtype's value; int8 and int4 are --quantize's, and the error says so."""
    if value in STORAGE_DTYPES:
        return value
    dtypes = " or ".join(STORAGE_DTYPES)
    if value in QUANTIZE_SCHEMES:
        raise argparse.ArgumentTypeError(
            f"{value} is a weight-only quantization, not a storage dtype: use --quantize {value} (and "
            f"--quantize-lm-head {value} for the LM head too); --dtype is what everything else is stored in, {dtypes}")
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {dtypes})")


def run(args: argparse.Namespace) -> int:
    from jaxserve.checkpoint import read_metadata
    from jaxserve.convert import ConvertError, convert
    from jaxserve.logs import configure_logging
    configure_logging("info")  # progress: a bar on a terminal, a line every few seconds elsewhere
    try:
        out = convert(args.hf_dir, args.out_dir, dtype=args.dtype, force=args.force, quantize=args.quantize,
                      quantize_lm_head=args.quantize_lm_head, dequantize=args.dequantize)
    except ConvertError as e:
        print(f"jaxserve convert: error: {e}", file=sys.stderr)
        return 1
    imported = read_metadata(out).get("imported_quantization")
    if imported:
        how = "dequantized to float" if imported["dequantized"] else f"stored as {imported['scheme']}"
        dropped = f"; {imported['dropped']} dropped: runs them at 16 bits" if imported["dropped"] else ""
        print(f"imported {imported['source']}, {how}{dropped}")
    print(f"wrote {out}")
    return 0
