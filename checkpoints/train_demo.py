"""Trains jaxserve's bundled demo model: a small Llama with its own sentencepiece tokenizer, on the Python
standard library's own sources (the *.py files of the interpreter running this script; PSF license).

    python checkpoints/train_demo.py --out checkpoints/demo            # the bundled model (see README.md)
    python checkpoints/train_demo.py --out /tmp/demo --minutes 10       # whatever fits in 10 minutes

Everything is seeded and the corpus is a sorted file list, so a rerun on the same Python version reproduces the
checkpoint's quality (bit-exact on the same machine and XLA build). Pipeline:

    stdlib *.py (sorted) ─► split by file: every 20th file held out
        train split ─► sentencepiece BPE (byte fallback) ─► tokenizer.model
        each file   ─► <s> ids </s>, concatenated ─► windows of seq_len + 1 tokens, shuffled per epoch
    random Llama ─► AdamW, linear warmup + cosine decay, f32 ─► held-out loss every eval_every steps
    ─► checkpoint (bfloat16 weights) + tokenizer files + training_summary.json (perplexity, samples)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import sentencepiece as spm
from flax import nnx

from jaxserve.checkpoint import load_model, params_to_nested, save_checkpoint
from jaxserve.config import ModelConfig, RopeConfig
from jaxserve.models.llama import Llama, abstract_model, weight_specs

BOS, EOS = "<s>", "</s>"
SAMPLE_PROMPTS = ("def ", "import os\n", "class ")
TOKENIZER_MAX_SENTENCES = 1_000_000  # above the stdlib's ~9,000 chunks: with shuffling off, every chunk in order
# A plain-text chat template: "### " lines are Python comments, so a model that only knows code keeps writing code.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "### {{ message['role'] | capitalize }}:\n{{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}### Assistant:\n{% endif %}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained model. The defaults are the bundled checkpoint's configuration."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 704
    tie_word_embeddings: bool = True
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1500  # ~70 min at the 2.8 s/step estimated for an idle 2-core CPU (README.md)
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to peak_lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adam_b2: float = 0.95
    heldout_every: int = 20  # every N-th file of the sorted list is held out
    eval_every: int = 250
    eval_windows: int = 64  # fixed held-out sample for the periodic evaluation
    compute_dtype: str = "float32"
    save_dtype: str = "bfloat16"
    seed: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


# ---------------------------------------------------------------- corpus


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Source texts split by file. `skipped` lists files that are not valid UTF-8 (left out of both splits)."""

    root: str
    train: tuple[str, ...]
    heldout: tuple[str, ...]
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    skipped: tuple[str, ...]

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for name, text in zip(self.train_files + self.heldout_files, self.train + self.heldout):
            digest.update(name.encode() + b"\0" + text.encode() + b"\0")
        return digest.hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> list[Path]:
    """Every *.py under the standard library directory, site-packages excluded, sorted by relative path."""
    files = (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(root: Path | None = None, heldout_every: int = 20, max_files: int | None = None) -> Corpus:
    """Reads the sources; file i (0-based, in sorted order) is held out when i % heldout_every == heldout_every - 1."""
    root = root or stdlib_root()
    paths = stdlib_sources(root)[:max_files]
    split: dict[bool, tuple[list[str], list[str]]] = {True: ([], []), False: ([], [])}
    skipped = []
    for i, path in enumerate(paths):
        name = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped.append(name)
            continue
        names, texts = split[i % heldout_every == heldout_every - 1]
        names.append(name)
        texts.append(text)
    (train_names, train), (held_names, held) = split[False], split[True]
    return Corpus(str(root), tuple(train), tuple(held), tuple(train_names), tuple(held_names), tuple(skipped))


# ---------------------------------------------------------------- tokenizer


def tokenizer_sentences(texts: tuple[str, ...], max_bytes: int = 4000) -> list[str]:
    """Whole-line chunks of at most max_bytes, newlines kept, so BPE learns pieces like '):\\n' and indentation."""
    sentences = []
    for text in texts:
        chunk, size = [], 0
        for line in text.splitlines(keepends=True):
            n = len(line.encode())
            if n > max_bytes:
                continue  # minified data lines; sentencepiece would drop them anyway
            if size + n > max_bytes:
                sentences.append("".join(chunk))
                chunk, size = [], 0
            chunk.append(line)
            size += n
        if chunk:
            sentences.append("".join(chunk))
    return sentences


def train_tokenizer(texts: tuple[str, ...], vocab_size: int, seed: int) -> spm.SentencePieceProcessor:
    """Deterministic BPE with byte fallback over the training split only. Text is kept as is (identity
    normalisation, no dummy prefix, whitespace runs allowed as pieces): code round-trips exactly."""
    sentences = tokenizer_sentences(texts)
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=0.9995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
        split_digits=True, max_sentence_length=8192, input_sentence_size=TOKENIZER_MAX_SENTENCES,
        shuffle_input_sentence=False, num_threads=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        unk_piece="<unk>", bos_piece=BOS, eos_piece=EOS, hard_vocab_limit=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_tokenizer_files(sp: spm.SentencePieceProcessor, out_dir: Path, tc: TrainConfig) -> dict[str, Any]:
    """tokenizer.model, tokenizer_config.json and generation_config.json, as a Llama-2 Hugging Face dir has them.
    Returns the generation config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.model").write_bytes(sp.serialized_model_proto())
    tokenizer_config = {
        "tokenizer_class": "LlamaTokenizer", "bos_token": BOS, "eos_token": EOS, "unk_token": "<unk>",
        "pad_token": None, "add_bos_token": True, "add_eos_token": False, "add_prefix_space": False,
        "legacy": False, "clean_up_tokenization_spaces": False, "model_max_length": tc.seq_len,
        "chat_template": CHAT_TEMPLATE}
    generation = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "do_sample": True,
                  "temperature": 0.8, "top_p": 0.95}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return generation


def encode_documents(sp: spm.SentencePieceProcessor, texts: tuple[str, ...]) -> np.ndarray:
    """One token stream: <s> file </s> <s> file </s> ... as int32."""
    docs = [np.asarray([sp.bos_id(), *ids, sp.eos_id()], np.int32) for ids in sp.encode(list(texts))]
    return np.concatenate(docs) if docs else np.zeros(0, np.int32)


# ---------------------------------------------------------------- data


def windows(stream: np.ndarray, seq_len: int, offset: int = 0) -> np.ndarray:
    """Non-overlapping windows [N, seq_len + 1] (inputs and shifted targets) starting at `offset`."""
    n = (len(stream) - offset - 1) // seq_len
    starts = offset + seq_len * np.arange(n)
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def training_batches(stream: np.ndarray, tc: TrainConfig, start_step: int = 0) -> Iterator[np.ndarray]:
    """Batches [batch, seq_len + 1] for steps start_step, start_step + 1, ...; epoch e shifts the windows by a
    seeded offset and shuffles them, so the order depends only on (seed, step)."""
    per_epoch = len(windows(stream, tc.seq_len, tc.seq_len - 1)) // tc.batch_size
    step = start_step
    while True:
        epoch, index = divmod(step, per_epoch)
        rng = np.random.default_rng([tc.seed, epoch])
        epoch_windows = windows(stream, tc.seq_len, int(rng.integers(tc.seq_len)))
        order = rng.permutation(len(epoch_windows))[: per_epoch * tc.batch_size].reshape(per_epoch, tc.batch_size)
        for batch in order[index:]:
            yield epoch_windows[batch]
            step += 1


def eval_sample(stream: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """`count` held-out windows spread evenly over the split (the periodic evaluation's fixed sample)."""
    all_windows = windows(stream, seq_len)
    return all_windows[np.linspace(0, len(all_windows) - 1, min(count, len(all_windows))).astype(int)]


# ---------------------------------------------------------------- model and optimiser


def model_config(tc: TrainConfig, sp: spm.SentencePieceProcessor) -> ModelConfig:
    """max_position_embeddings is the training length: RoPE positions beyond it were never seen."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=sp.get_piece_size(), hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size, num_layers=tc.num_layers, num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads, head_dim=tc.hidden_size // tc.num_heads, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), max_position_embeddings=tc.seq_len,
        tie_word_embeddings=tc.tie_word_embeddings, bos_token_id=sp.bos_id(), eos_token_ids=(sp.eos_id(),),
        dtype=tc.save_dtype)


def init_params(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, dict[str, Any]]:
    """float32 master weights as a nested dict, initialised as `weight_specs` declares (normal: std 0.02), from
    numpy's seeded generator (jax.random would spend seconds compiling one sampler per shape), plus the graph
    that rebuilds the module from them."""
    rng = np.random.default_rng(seed)
    init = {"normal": lambda shape: 0.02 * rng.standard_normal(shape, np.float32),
            "ones": lambda shape: np.ones(shape, np.float32), "zeros": lambda shape: np.zeros(shape, np.float32)}
    flat = {path: jnp.asarray(init[spec.init](spec.shape)) for path, spec in weight_specs(cfg).items()}
    graphdef, _ = nnx.split(abstract_model(cfg, jnp.float32))
    return graphdef, params_to_nested(flat)


def as_model(graphdef: nnx.GraphDef, params: dict[str, Any]) -> Llama:
    return nnx.merge(graphdef, nnx.State(params))


def decay_mask(params: dict[str, Any]) -> dict[str, Any]:
    """Weight decay on matrices only: not on norms (stacked norms are 2-D, hence by name)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path), params)


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW without its learning rate: the step multiplies by the host-computed rate (see learning_rate)."""
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip), optax.scale_by_adam(b2=tc.adam_b2),
                       optax.add_decayed_weights(tc.weight_decay, decay_mask))


def learning_rate(step: int, tc: TrainConfig, total_steps: int) -> float:
    """Linear warmup to peak_lr, then cosine to peak_lr * min_lr_ratio at total_steps."""
    if step < tc.warmup_steps:
        return tc.peak_lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, total_steps - tc.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return tc.peak_lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * cosine)


def token_nll(graphdef, params, tokens: jax.Array, compute_dtype) -> jax.Array:
    """Per-token negative log-likelihood [B, T] of tokens[:, 1:] given tokens[:, :-1]."""
    params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    logits = as_model(graphdef, params).forward_dense(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def make_train_step(graphdef, tx: optax.GradientTransformation, compute_dtype):
    def loss_fn(params, tokens):
        return token_nll(graphdef, params, tokens, compute_dtype).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, tokens, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, loss, optax.tree.norm(grads)

    return train_step


def make_eval_step(graphdef):
    @jax.jit
    def eval_step(params, tokens, weights):
        """Sum of NLL (float32 compute) over the windows with weight 1 (padding has weight 0), and their count."""
        nll = token_nll(graphdef, params, tokens, jnp.float32)
        return (nll * weights[:, None]).sum(), weights.sum() * nll.shape[1]

    return eval_step


def mean_nll(eval_step, params, all_windows: np.ndarray, batch_size: int) -> float:
    """Mean per-token NLL over every window, in fixed-size batches (the last one padded, weight 0)."""
    total, count = 0.0, 0.0
    for start in range(0, len(all_windows), batch_size):
        batch = all_windows[start:start + batch_size]
        weights = np.zeros(batch_size, np.float32)
        weights[:len(batch)] = 1.0
        batch = np.concatenate([batch, np.zeros((batch_size - len(batch), batch.shape[1]), batch.dtype)])
        nll, n = eval_step(params, batch, weights)
        total, count = total + float(nll), count + float(n)
    return total / count


# ---------------------------------------------------------------- sampling


def make_sampler(graphdef, seq_len: int):
    @jax.jit
    def next_token(params, buffer, length, key, temperature):
        """buffer [seq_len] (valid up to length) -> the next token: greedy at temperature 0, else sampled."""
        logits = as_model(graphdef, params).forward_dense(buffer[None])[0, length - 1]
        sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
        return jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(jnp.int32)

    return next_token


def generate(next_token, params, sp: spm.SentencePieceProcessor, prompt: str, *, seq_len: int,
             max_new_tokens: int, temperature: float, seed: int) -> str:
    """A plain loop over forward_dense (one full window per token); stops at </s> or the window's end."""
    ids = [sp.bos_id(), *sp.encode(prompt)]
    buffer = np.zeros(seq_len, np.int32)
    buffer[:len(ids)] = ids
    key = jax.random.key(seed)
    new: list[int] = []
    for i in range(min(max_new_tokens, seq_len - len(ids))):
        token = int(next_token(params, buffer, len(ids) + i, jax.random.fold_in(key, i), temperature))
        if token == sp.eos_id():
            break
        buffer[len(ids) + i] = token
        new.append(token)
    return prompt + sp.decode(new)


def samples(next_token, params, sp, seq_len: int, max_new_tokens: int, seed: int) -> list[dict[str, Any]]:
    """A greedy and a temperature-0.8 continuation of each of SAMPLE_PROMPTS (sample i seeded seed + i)."""
    out = []
    for i, (prompt, temperature) in enumerate((p, t) for p in SAMPLE_PROMPTS for t in (0.0, 0.8)):
        text = generate(next_token, params, sp, prompt, seq_len=seq_len, max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=seed + i)
        out.append({"prompt": prompt, "temperature": temperature, "seed": seed + i, "text": text})
    return out


# ---------------------------------------------------------------- training loop


@dataclasses.dataclass
class TrainState:
    params: dict[str, Any]
    opt_state: Any
    step: int = 0


def save_train_state(state: TrainState, path: Path) -> None:
    """Resume point: every leaf of params and optimiser state, in tree order, plus the step (no pickle)."""
    leaves = jax.tree.leaves((state.params, state.opt_state))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, step=state.step, **{f"leaf_{i}": np.asarray(x) for i, x in enumerate(leaves)})
    tmp.replace(path)


def load_train_state(state: TrainState, path: Path) -> TrainState:
    """Fills a freshly initialised state (for its tree structure) from save_train_state's file."""
    treedef = jax.tree.structure((state.params, state.opt_state))
    with np.load(path) as data:
        leaves = [jnp.asarray(data[f"leaf_{i}"]) for i in range(treedef.num_leaves)]
        params, opt_state = jax.tree.unflatten(treedef, leaves)
        return TrainState(params, opt_state, int(data["step"]))


@dataclasses.dataclass
class Log:
    """What the run prints and records: train loss per logged step, held-out loss per evaluation."""

    start: float = dataclasses.field(default_factory=time.perf_counter)
    train: list[dict[str, float]] = dataclasses.field(default_factory=list)
    heldout: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def print(self, message: str) -> None:
        print(f"[{self.elapsed() / 60:6.1f} min] {message}", flush=True)


@dataclasses.dataclass
class StepClock:
    """Seconds spent in training steps, leaving out each session's first steps (they include compilation)."""

    untimed: int = 2
    steps: int = 0
    seconds: float = 0.0

    def record(self, seconds: float) -> None:
        if self.untimed:
            self.untimed -= 1
        else:
            self.steps, self.seconds = self.steps + 1, self.seconds + seconds

    def seconds_per_step(self) -> float:
        return self.seconds / max(1, self.steps)

    def tokens_per_second(self, tokens_per_step: int) -> float | None:
        return self.steps * tokens_per_step / self.seconds if self.seconds else None


def train(tc: TrainConfig, graphdef, eval_step, state: TrainState, stream: np.ndarray, eval_windows: np.ndarray,
          total_steps: int | None, minutes: float | None, log: Log, state_path: Path | None = None
          ) -> tuple[TrainState, int, StepClock]:
    """Runs until total_steps or, with `minutes` (total_steps None), until the step count that the speed
    measured during warmup allows. Returns the state, the final step count and the step clock."""
    train_step = make_train_step(graphdef, optimizer(tc), jnp.dtype(tc.compute_dtype))
    batches = training_batches(stream, tc, state.step)
    clock = StepClock()
    calibrate_at = max(5, min(tc.warmup_steps, 30))  # --minutes: a few timed steps, ideally still in warmup
    while total_steps is None or state.step < total_steps:
        if total_steps is None and state.step == calibrate_at:
            total_steps = steps_for_budget(minutes * 60 - log.elapsed(), clock.seconds_per_step(), state.step, log)
        lr = learning_rate(state.step, tc, total_steps or tc.steps)  # warmup does not depend on the total
        t0 = time.perf_counter()
        state.params, state.opt_state, loss, grad_norm = train_step(state.params, state.opt_state, next(batches), lr)
        loss = float(loss)
        clock.record(time.perf_counter() - t0)
        state.step += 1
        log_step(tc, state.step, total_steps, loss, float(grad_norm), lr, clock, log)
        if state.step % tc.eval_every == 0 or state.step == total_steps:
            heldout = mean_nll(eval_step, state.params, eval_windows, tc.batch_size)
            log.heldout.append({"step": state.step, "loss": heldout, "minutes": log.elapsed() / 60})
            log.print(f"step {state.step}: held-out loss {heldout:.4f} (ppl {math.exp(heldout):.2f}, fixed sample)")
            if state_path is not None:
                save_train_state(state, state_path)
    return state, total_steps, clock


def steps_for_budget(seconds_left: float, seconds_per_step: float, done: int, log: Log) -> int:
    reserve = 0.04 * seconds_left  # periodic and final evaluation, samples, checkpoint: ~2.5% in the full run
    steps = done + max(1, int((seconds_left - reserve) / seconds_per_step))
    log.print(f"measured {seconds_per_step:.3f} s/step: training for {steps} steps")
    return steps


def log_step(tc, step, total_steps, loss, grad_norm, lr, clock: StepClock, log: Log) -> None:
    log.train.append({"step": step, "loss": loss})
    if step % 25 == 0 or step in (1, 2):
        rate = clock.tokens_per_second(tc.tokens_per_step) or 0.0
        log.print(f"step {step}/{total_steps or '?'}  loss {loss:.4f}  |g| {grad_norm:.2f}  lr {lr:.2e}  "
                  f"{rate:,.0f} tok/s")


# ---------------------------------------------------------------- putting it together


def save_demo_checkpoint(out: Path, cfg: ModelConfig, params, sp, tc: TrainConfig) -> Path:
    saved = jax.tree.map(lambda p: np.asarray(jnp.asarray(p).astype(tc.save_dtype)), params)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        generation = write_tokenizer_files(sp, Path(tokenizer_dir), tc)
        return save_checkpoint(out, cfg, saved, tokenizer_dir=tokenizer_dir, generation=generation)


def load_saved(out: Path) -> tuple[nnx.GraphDef, dict[str, Any]]:
    """The checkpoint as `jaxserve serve` sees it (weights rounded to the saved dtype), in float32."""
    graphdef, state = nnx.split(load_model(out, dtype="float32"))
    return graphdef, nnx.to_pure_dict(state)


def heldout_nll(eval_step, params, tc: TrainConfig, heldout: np.ndarray) -> float:
    """Mean NLL over every held-out window of seq_len target tokens (the split's last partial window left out)."""
    return mean_nll(eval_step, params, windows(heldout, tc.seq_len), tc.batch_size)


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclasses.dataclass(frozen=True)
class Data:
    sp: spm.SentencePieceProcessor
    train: np.ndarray  # token stream of the training split
    heldout: np.ndarray  # token stream of the held-out split


def prepare_data(tc: TrainConfig, corpus: Corpus, log: Log, tokenizer_from: Path | None = None) -> Data:
    """`tokenizer_from`: a checkpoint directory whose tokenizer.model is reused instead of training one (a draft
    model for speculative decoding must share its target's token ids)."""
    log.print(f"corpus {corpus.root}: {len(corpus.train_files)} train / {len(corpus.heldout_files)} held-out files "
              f"({len(corpus.skipped)} not UTF-8, skipped)")
    if tokenizer_from is None:
        sp = train_tokenizer(corpus.train, tc.vocab_size, tc.seed)
    else:
        sp = spm.SentencePieceProcessor(model_file=str(tokenizer_from / "tokenizer.model"))
        if sp.get_piece_size() != tc.vocab_size:
            raise SystemExit(f"{tokenizer_from}/tokenizer.model has {sp.get_piece_size()} pieces, not the "
                             f"vocab_size {tc.vocab_size} asked for: pass --set vocab_size={sp.get_piece_size()}")
    data = Data(sp, encode_documents(sp, corpus.train), encode_documents(sp, corpus.heldout))
    log.print(f"tokenizer: {sp.get_piece_size()} pieces; {len(data.train):,} train / "
              f"{len(data.heldout):,} held-out tokens")
    return data


def initial_state(cfg: ModelConfig, tc: TrainConfig, state_path: Path | None, log: Log):
    graphdef, params = init_params(cfg, tc.seed)
    state = TrainState(params, optimizer(tc).init(params))
    if state_path is not None and state_path.exists():
        state = load_train_state(state, state_path)
        log.print(f"resumed at step {state.step} from {state_path}")
    log.print(f"model: {cfg.num_params():,} parameters; {tc.tokens_per_step} tokens per step")
    return graphdef, state


def run(tc: TrainConfig, out: Path, corpus: Corpus, minutes: float | None = None, resume: bool = False,
        max_new_tokens: int = 96, tokenizer_from: Path | None = None) -> dict[str, Any]:
    """The whole pipeline; returns (and writes to out/training_summary.json) the run's summary."""
    log, load_at_start = Log(), os.getloadavg()
    data = prepare_data(tc, corpus, log, tokenizer_from)
    cfg = model_config(tc, data.sp)
    state_path = out.parent / f".{out.name}.train_state.npz" if resume else None
    graphdef, state = initial_state(cfg, tc, state_path, log)
    minutes_setup, resumed_at = log.elapsed() / 60, state.step
    eval_step = make_eval_step(graphdef)  # the saved model has the same graph: one compilation serves both
    state, total, clock = train(tc, graphdef, eval_step, state, data.train, eval_sample(
        data.heldout, tc.seq_len, tc.eval_windows), None if minutes else tc.steps, minutes, log, state_path)
    minutes_training = log.elapsed() / 60 - minutes_setup
    save_demo_checkpoint(out, cfg, state.params, data.sp, tc)
    saved_graphdef, saved_params = load_saved(out)
    nll = heldout_nll(eval_step, saved_params, tc, data.heldout)
    log.print(f"held-out loss {nll:.4f}, perplexity {math.exp(nll):.2f} (whole held-out split)")
    summary = make_summary(tc, cfg, corpus, data, state.step, total, clock, nll, log)
    summary["resumed_at_step"] = resumed_at
    summary["machine"]["load_average_at_start"] = load_at_start
    next_token = make_sampler(saved_graphdef, tc.seq_len)
    summary["samples"] = samples(next_token, saved_params, data.sp, tc.seq_len, max_new_tokens, tc.seed)
    summary["wall_minutes"] = {"setup": minutes_setup, "training": minutes_training, "total": log.elapsed() / 60}
    summary["checkpoint_bytes"] = directory_bytes(out)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    if state_path is not None and state_path.exists():
        state_path.unlink()
    log.print(f"wrote {out} ({summary['checkpoint_bytes'] / 1e6:.1f} MB)")
    return summary


def make_summary(tc: TrainConfig, cfg: ModelConfig, corpus: Corpus, data: Data, steps: int, planned: int,
                 clock: StepClock, nll: float, log: Log) -> dict[str, Any]:
    heldout_bytes = sum(len(t.encode()) for t in corpus.heldout)
    return {
        "train_config": dataclasses.asdict(tc),
        "parameters": cfg.num_params(),
        "corpus": {"root": corpus.root, "python": platform.python_version(), "fingerprint": corpus.fingerprint(),
                   "train_files": len(corpus.train_files), "heldout_files": len(corpus.heldout_files),
                   "skipped_not_utf8": list(corpus.skipped), "train_tokens": int(len(data.train)),
                   "heldout_tokens": int(len(data.heldout)),
                   "train_bytes": sum(len(t.encode()) for t in corpus.train), "heldout_bytes": heldout_bytes},
        "tokenizer": {"vocab_size": data.sp.get_piece_size(),
                      "heldout_bytes_per_token": heldout_bytes / max(1, len(data.heldout))},
        "steps": steps, "planned_steps": planned, "tokens_seen": steps * tc.tokens_per_step,
        "epochs": steps * tc.tokens_per_step / len(data.train),
        "steps_per_second": clock.tokens_per_second(1),
        "tokens_per_second": clock.tokens_per_second(tc.tokens_per_step),
        "heldout": {"loss": nll, "perplexity": math.exp(nll),
                    "target_tokens": len(windows(data.heldout, tc.seq_len)) * tc.seq_len,
                    "bits_per_byte": nll * len(data.heldout) / heldout_bytes / math.log(2),
                    "weights": tc.save_dtype, "compute": "float32"},
        "curve": {"heldout": log.heldout, "train": log.train[::25]},
        "machine": {"platform": platform.platform(), "jax": jax.__version__, "devices": str(jax.devices()),
                    "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
    }


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help=f"training steps (default {TrainConfig.steps})")
    budget.add_argument("--minutes", type=float, help="train for as many steps as fit in this wall time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true",
                        help="save a resume point next to --out at every evaluation and continue from it")
    parser.add_argument("--max-files", type=int, help="use only the first N corpus files (quick trials)")
    parser.add_argument("--tokenizer-from", type=Path, metavar="DIR",
                        help="reuse DIR/tokenizer.model instead of training a tokenizer (e.g. a draft model for "
                             "speculative decoding: --tokenizer-from checkpoints/demo)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a TrainConfig field, e.g. --set hidden_size=320 (repeatable)")
    args = parser.parse_args(argv)
    if args.resume and args.minutes is not None:
        parser.error("--resume needs a fixed --steps (with --minutes the step count depends on the speed)")
    overrides = dict(item.split("=", 1) for item in args.set)
    types = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    unknown = set(overrides) - set(types)
    if unknown:
        parser.error(f"unknown TrainConfig fields: {', '.join(sorted(unknown))}")
    parse = {"int": int, "float": float, "str": str, "bool": lambda v: v.lower() in ("1", "true", "yes")}
    values = {k: parse[types[k]](v) for k, v in overrides.items()}
    tc = TrainConfig(**{**values, "seed": args.seed, **({"steps": args.steps} if args.steps else {})})
    return args, tc


def main(argv: list[str] | None = None) -> int:
    args, tc = parse_args(argv)
    corpus = load_corpus(heldout_every=tc.heldout_every, max_files=args.max_files)
    summary = run(tc, args.out, corpus, minutes=args.minutes, resume=args.resume, tokenizer_from=args.tokenizer_from)
    print(json.dumps({k: summary[k] for k in ("parameters", "steps", "tokens_seen", "wall_minutes",
                                              "tokens_per_second", "heldout")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
