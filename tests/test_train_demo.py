"""Smoke test of checkpoints/train_demo.py: a tiny model on a slice of the stdlib corpus, end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("optax")  # the `train` extra

SCRIPT = Path(__file__).resolve().parents[1] / "checkpoints" / "train_demo.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


td = _load_script()

TINY = td.TrainConfig(vocab_size=384, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, seq_len=32, batch_size=8, steps=20, peak_lr=3e-3, warmup_steps=3,
                      eval_every=10, eval_windows=16)


@pytest.fixture(scope="module")
def corpus():
    return td.load_corpus(max_files=40, heldout_every=10)


def test_corpus_split_is_by_file_and_deterministic(corpus):
    assert len(corpus.heldout_files) == 4 and len(corpus.train_files) + len(corpus.skipped) == 36
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    assert corpus.fingerprint() == td.load_corpus(max_files=40, heldout_every=10).fingerprint()


def test_tokenizer_is_deterministic_and_round_trips_code(corpus):
    sp = td.train_tokenizer(corpus.train[:10], 600, seed=0)
    again = td.train_tokenizer(corpus.train[:10], 600, seed=0)
    assert sp.serialized_model_proto() == again.serialized_model_proto()
    code = "def f(x):\n    return {'a': x}  # é ✓\n\n\tpass\n"
    assert sp.decode(sp.encode(code)) == code
    assert (sp.bos_id(), sp.eos_id(), sp.id_to_piece(sp.bos_id())) == (1, 2, "<s>")


def test_batches_depend_only_on_seed_and_step():
    stream = np.arange(5000, dtype=np.int32)
    fresh = td.training_batches(stream, TINY)
    first = [next(fresh) for _ in range(25)]  # crosses an epoch boundary (19 batches per epoch)
    resumed = td.training_batches(stream, TINY, start_step=20)
    assert np.array_equal(next(resumed), first[20])
    assert np.array_equal(first[0][:, 1:], first[0][:, :-1] + 1)  # windows are contiguous


def test_learning_rate_warms_up_then_decays_to_the_floor():
    rates = [td.learning_rate(s, TINY, 30) for s in range(31)]
    assert rates[2] == pytest.approx(TINY.peak_lr) and rates[0] < rates[1] < rates[2]
    assert all(a >= b for a, b in zip(rates[2:], rates[3:]))
    assert rates[30] == pytest.approx(TINY.peak_lr * TINY.min_lr_ratio)


def test_training_run_lowers_loss_and_writes_a_loadable_checkpoint(corpus, tmp_path):
    from jaxserve.checkpoint import load_model

    out = tmp_path / "demo"
    summary = td.run(TINY, out, corpus, max_new_tokens=2)
    heldout = [point["loss"] for point in summary["curve"]["heldout"]]  # after steps 10 and 20
    initial = summary["curve"]["train"][0]["loss"]  # step 1: about ln(vocab)
    assert heldout[-1] < heldout[0] and heldout[-1] < initial - 0.5, (initial, heldout)
    assert summary["heldout"]["perplexity"] < np.exp(heldout[0])
    for name in ("tokenizer.model", "tokenizer_config.json", "generation_config.json", "jaxserve.json",
                 "training_summary.json"):
        assert (out / name).is_file(), name
    meta = json.loads((out / "jaxserve.json").read_text())
    assert meta["model"]["dtype"] == "bfloat16" and meta["generation"]["eos_token_id"] == 2
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    model = load_model(out)  # run() already scored the reloaded weights: the perplexity above is theirs
    assert model.cfg == td.model_config(TINY, td.train_tokenizer(corpus.train, TINY.vocab_size, TINY.seed))
    assert model.embed.dtype == np.dtype("bfloat16") and np.isfinite(np.asarray(model.embed[...], np.float32)).all()
    assert len(summary["samples"]) == 2 * len(td.SAMPLE_PROMPTS)
    assert all(s["text"].startswith(s["prompt"]) for s in summary["samples"])
