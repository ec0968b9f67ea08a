#!/usr/bin/env python3
"""Accuracy cost of each quantization scheme: held-out perplexity and next-token KL divergence vs the float model.

    python bench/quant_accuracy.py --model checkpoints/demo                        # the demo's held-out split
    python bench/quant_accuracy.py --model DIR --text FILE_OR_DIR ...              # any checkpoint + any text
    python bench/quant_accuracy.py --model DIR --schemes int8 int4 kv-int8 kv-fp8 int4+kv-int8 --out r.json

Text: with `--model checkpoints/demo` and no --text, the held-out split that checkpoints/train_demo.py defines
(every 20th stdlib file, `<s> file </s>` concatenated, its own sentencepiece tokenizer), scored as the training
script scores it: non-overlapping windows of seq_len tokens from the stream's start, each from its own start.
With --text, the files (directories: every *.py, *.txt, *.md under them, sorted) are tokenized with the
checkpoint's tokenizer, one `<s> file </s>` document each. --max-windows takes that many windows evenly spread
over the stream (the full split is the default for the demo, ~1,700 windows; each scheme costs one forward
pass over them).

Schemes: "int8" / "int4" quantize the decoder projections (jaxserve.quant.model.quantize_model, the arrays
`jaxserve convert --quantize` writes); "kv-int8" / "kv-fp8" round K and V as a quantized paged cache stores them
(forward_dense(kv_cache_dtype=...); tests/test_quant_engine.py checks the engine gives the same greedy tokens);
"a+b" combines. Metrics per scheme, over every scored token (teacher forcing):

    perplexity     exp(mean NLL), and its change vs the float model in percent
    KL             mean KL(p_float || p_scheme) of the next-token distributions, in nats
    top-1 agree    share of positions where both models' most likely next token is the same

--check exits 1 when int8 perplexity rises by more than 1% or int4 by more than 5% (issue 6's bounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout

from jaxserve.checkpoint import load_model  # noqa: E402
from jaxserve.models.llama import Llama  # noqa: E402
from jaxserve.quant.kv import kv_storage_dtype  # noqa: E402
from jaxserve.quant.memory import kv_bytes_per_token, weight_bytes  # noqa: E402
from jaxserve.quant.model import quantize_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN_DEMO = ROOT / "checkpoints" / "train_demo.py"
DEFAULT_SCHEMES = ("int8", "int4", "kv-int8", "kv-fp8")
PPL_BOUNDS = {"int8": 1.0, "int4": 5.0}  # percent perplexity increase allowed (issue 6)
TEXT_SUFFIXES = (".py", ".txt", ".md")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A scheme spec such as "int4+kv-int8": weight scheme and KV-cache dtype name (either may be None)."""

    name: str
    weights: str | None
    kv: str | None

    @classmethod
    def parse(cls, spec: str) -> "Scheme":
        weights = kv = None
        for part in spec.split("+"):
            if part in ("int8", "int4"):
                weights = part
            elif part in ("kv-int8", "kv-fp8"):
                kv = part.removeprefix("kv-")
            else:
                raise SystemExit(f"unknown scheme part {part!r} in {spec!r}: use int8, int4, kv-int8, kv-fp8, '+'")
        return cls(spec, weights, kv)


# ---------------------------------------------------------------------------------------------- text

def demo_heldout_stream(model_dir: Path) -> np.ndarray:
    """train_demo.py's held-out token stream: its corpus split, its sentencepiece model, its document framing."""
    import sentencepiece as spm
    if not (model_dir / "tokenizer.model").exists():
        raise SystemExit(f"{model_dir} has no tokenizer.model: it is not the demo model; pass --text FILES")
    spec = importlib.util.spec_from_file_location("train_demo", TRAIN_DEMO)
    td = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = td  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(td)
    corpus = td.load_corpus(heldout_every=td.TrainConfig.heldout_every)
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    return td.encode_documents(sp, corpus.heldout)


def text_stream(model_dir: Path, paths: list[str]) -> np.ndarray:
    """<s> file </s> per text file, with the checkpoint's tokenizer."""
    from jaxserve.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(model_dir)
    docs = []
    for path in text_files(paths):
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        docs.append(np.asarray(bos + ids + list(tokenizer.eos_token_ids[:1]), np.int32))
    if not docs:
        raise SystemExit(f"no text files under {paths}")
    return np.concatenate(docs)


def text_files(paths: list[str]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        files += sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES) if p.is_dir() else [p]
    return files


def windows(stream: np.ndarray, seq_len: int, max_windows: int | None) -> np.ndarray:
    """Non-overlapping [N, seq_len + 1] windows from the stream's start (as train_demo.heldout_nll scores);
    max_windows of them evenly spread when given."""
    n = (len(stream) - 1) // seq_len
    if n == 0:
        raise SystemExit(f"the text has {len(stream)} tokens, fewer than one window of {seq_len + 1}")
    picked = np.arange(n) if not max_windows or max_windows >= n else np.linspace(0, n - 1, max_windows).astype(int)
    starts = picked * seq_len
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]]


# ---------------------------------------------------------------------------------------------- scoring

def make_scorer(base: Llama, variant: Llama, kv_dtype):
    """jit: tokens [B, T + 1] -> per-window sums over T positions of (NLL, KL(float || variant), top-1 agree),
    plus the float model's NLL."""
    base_def, base_state = nnx.split(base)
    var_def, var_state = nnx.split(variant)

    @jax.jit
    def score(base_state, var_state, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        ref = jax.nn.log_softmax(nnx.merge(base_def, base_state).forward_dense(inputs), axis=-1)
        got = jax.nn.log_softmax(nnx.merge(var_def, var_state).forward_dense(inputs, kv_cache_dtype=kv_dtype), -1)
        pick = lambda lp: -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]  # noqa: E731
        kl = (jnp.exp(ref) * (ref - got)).sum(-1)
        agree = ref.argmax(-1) == got.argmax(-1)
        return pick(ref).sum(-1), pick(got).sum(-1), kl.sum(-1), agree.sum(-1)

    return lambda tokens: score(base_state, var_state, tokens)


def evaluate(base: Llama, scheme: Scheme, data: np.ndarray, batch: int) -> dict:
    variant = quantize_model(base, scheme.weights) if scheme.weights else base
    kv_dtype = kv_storage_dtype(scheme.kv, base.dtype) if scheme.kv else None
    scorer = make_scorer(base, variant, kv_dtype)
    totals = np.zeros(4)
    started = time.perf_counter()
    for i in range(0, len(data), batch):
        chunk = data[i:i + batch]
        pad = batch - len(chunk)  # a fixed batch shape: one compile; padded rows are dropped below
        out = scorer(jnp.asarray(np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])))
        totals += [float(np.asarray(x)[:len(chunk)].sum()) for x in out]
    tokens = data.shape[0] * (data.shape[1] - 1)
    base_nll, nll, kl, agree = totals / tokens
    return dict(scheme=scheme.name, tokens=tokens, base_nll=base_nll, nll=nll, base_ppl=math.exp(base_nll),
                ppl=math.exp(nll), ppl_change_pct=100 * (math.exp(nll - base_nll) - 1), kl=kl, top1_agree=agree,
                weight_bytes=weight_bytes(variant.cfg, jnp.dtype(base.dtype).name),
                kv_bytes_per_token=kv_bytes_per_token(base.cfg, scheme.kv or "auto", jnp.dtype(base.dtype).name),
                seconds=time.perf_counter() - started)


def table(rows: list[dict], base: dict) -> str:
    head = ("| scheme | perplexity | change | mean KL (nats) | top-1 agree | weights MiB | KV B/token |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = [f"| float ({base['dtype']}) | {rows[0]['base_ppl']:.3f} | | | | {base['weight_bytes'] / 2**20:.2f} "
             f"| {base['kv_bytes_per_token']} |"]
    for r in rows:
        bound = PPL_BOUNDS.get(r["scheme"])
        verdict = "" if bound is None else (" ok" if r["ppl_change_pct"] <= bound else f" > {bound:g}%")
        lines.append(f"| {r['scheme']} | {r['ppl']:.3f} | {r['ppl_change_pct']:+.2f}%{verdict} | {r['kl']:.5f} | "
                     f"{100 * r['top1_agree']:.2f}% | {r['weight_bytes'] / 2**20:.2f} | {r['kv_bytes_per_token']} |")
    return head + "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a float jaxserve checkpoint")
    ap.add_argument("--text", nargs="+", help="held-out text files or directories (default for the demo: its split)")
    ap.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES))
    ap.add_argument("--seq-len", type=int, help="tokens per window (default: min(256, max_position_embeddings))")
    ap.add_argument("--max-windows", type=int, help="score this many windows, evenly spread (default: all)")
    ap.add_argument("--batch", type=int, default=16, help="windows per forward pass")
    ap.add_argument("--dtype", default="float32", help="compute dtype of the float parts (float32 | bfloat16)")
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--markdown", help="write the table as Markdown")
    ap.add_argument("--check", action="store_true", help="exit 1 if int8 ppl rises > 1%% or int4 > 5%%")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = Path(args.model)
    base = load_model(model_dir, dtype=args.dtype)
    if base.cfg.quantization:
        raise SystemExit(f"{model_dir} is already quantized ({base.cfg.quantization}); pass the float checkpoint")
    stream = text_stream(model_dir, args.text) if args.text else demo_heldout_stream(model_dir)
    seq_len = args.seq_len or min(256, base.cfg.max_position_embeddings)
    data = windows(stream, seq_len, args.max_windows)
    print(f"{model_dir}: {base.cfg.num_params():,} parameters, {len(stream):,} held-out tokens, "
          f"{len(data)} windows of {seq_len} scored, {args.dtype} compute, {jax.devices()[0].platform}", flush=True)
    rows = []
    for spec in args.schemes:
        rows.append(evaluate(base, Scheme.parse(spec), data, args.batch))
        r = rows[-1]
        print(f"  {spec:>14}: ppl {r['base_ppl']:.3f} -> {r['ppl']:.3f} ({r['ppl_change_pct']:+.2f}%), "
              f"KL {r['kl']:.5f}, top-1 agree {100 * r['top1_agree']:.2f}% ({r['seconds']:.0f} s)", flush=True)
    base_info = dict(dtype=args.dtype, weight_bytes=weight_bytes(base.cfg, args.dtype),
                     kv_bytes_per_token=kv_bytes_per_token(base.cfg, "auto", args.dtype))
    markdown = table(rows, base_info)
    print(markdown)
    result = dict(model=str(model_dir), text=args.text or "train_demo held-out split", seq_len=seq_len,
                  windows=len(data), stream_tokens=int(len(stream)), base=base_info, schemes=rows,
                  platform=jax.devices()[0].platform)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown + "\n")
    failed = [r["scheme"] for r in rows if r["ppl_change_pct"] > PPL_BOUNDS.get(r["scheme"], math.inf)]
    if args.check and failed:
        print(f"perplexity bound exceeded: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
