"""Draft-model proposals (--speculative-method draft --speculative-model DIR): a small jaxserve checkpoint that
shares the target's tokenizer guesses the next K tokens, the target verifies them.

The draft runs inside the target's step executables (jaxserve.engine.runner: `step`, `verify_step`,
`draft_proposals`), so it adds no dispatch and no host round trip:

    every step     the draft's forward pass over the step's query tokens, with the target's block tables, into its
                   own paged cache: the same page ids and page count as the target's (one memory plan counts both
                   per page), so whatever a page of the target's cache holds, the draft's holds for the same
                   tokens; prefill chunks, decodes, verify rows, prefix-cache hits and preemption need nothing more
    verify step    first K single-token draft steps for the speculating rows, in one loop on device, each drawing
                   the next proposal from the draft's distribution q; then the target verifies them against q
                   (exact rejection sampling, jaxserve.engine.sampler.verify)

The scheduler sees the proposals as K placeholder query tokens (`DeviceProposals`); the accepted ones come back
with the step's tokens. The checks here run at start-up: a draft must read and write the same token ids.
"""

from __future__ import annotations

import os

from jaxserve.config import ConfigError, ModelConfig


class DeviceProposals:
    """The scheduler's proposer when a draft model proposes on device: k placeholder tokens, for which the
    scheduler reserves query positions and pages; the verify step writes the draft's proposals over them.
    `keeps_cache`: the draft's own cache must hold a sequence's tokens before it proposes (the scheduler tracks
    which pages a step without the draft's forward pass left behind)."""

    keeps_cache = True

    def propose(self, seq, k: int) -> tuple[int, ...]:
        return (0,) * k


def check_draft_config(draft: ModelConfig, target: ModelConfig, max_model_len: int, where: str = "the draft") -> None:
    """A draft the engine can run beside `target`: the same vocabulary size (its distributions are compared token
    for token with the target's) and room for max_model_len positions."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"{where} has a vocabulary of {draft.vocab_size} tokens and the target {target.vocab_size}: "
                          f"a draft model must share the target's tokenizer and vocabulary size")
    if draft.max_position_embeddings < max_model_len:
        raise ConfigError(f"{where} handles {draft.max_position_embeddings} positions, fewer than max_model_len "
                          f"{max_model_len}: lower --max-model-len or use a draft with a longer context")


def check_draft_tokenizer(draft, target, where: str) -> None:
    """The draft's tokenizer (jaxserve.tokenizer.Tokenizer) maps text to the target's ids: same vocabulary, same
    special tokens. ConfigError naming the first difference."""
    differences = [(name, getattr(draft, name), getattr(target, name))
                   for name in ("vocab_size", "bos_token_id", "eos_token_ids", "pad_token_id", "unk_token_id",
                                "all_special_ids")
                   if getattr(draft, name) != getattr(target, name)]
    if differences:
        name, ours, theirs = differences[0]
        raise ConfigError(f"{where}'s tokenizer differs from the target's ({name}: {ours} vs {theirs}); a draft "
                          f"model must share the target's tokenizer")
    draft_vocab, target_vocab = draft.backend.get_vocab(), target.backend.get_vocab()
    if draft_vocab != target_vocab:
        token = next(t for t in sorted(set(draft_vocab) | set(target_vocab))
                     if draft_vocab.get(t) != target_vocab.get(t))
        raise ConfigError(f"{where}'s tokenizer differs from the target's: {token!r} is id {draft_vocab.get(token)} "
                          f"in the draft and {target_vocab.get(token)} in the target; a draft model must share the "
                          f"target's tokenizer")


def load_draft(path: str | os.PathLike, target: ModelConfig, target_tokenizer, dtype: str, max_model_len: int):
    """The draft checkpoint at `path`, checked against the target (config, and tokenizer when the target has
    one), loaded in `dtype` on the default device (the engine places it)."""
    from jaxserve.checkpoint import load_model
    from jaxserve.tokenizer import load_tokenizer
    where = f"the draft model {os.fspath(path)}"
    try:
        cfg = ModelConfig.load(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--speculative-model {os.fspath(path)}: {exc}") from None
    check_draft_config(cfg, target, max_model_len, where)
    if target_tokenizer is not None:
        try:
            tokenizer = load_tokenizer(path, model_type=cfg.family)
        except FileNotFoundError as exc:
            raise ConfigError(f"{where} has no tokenizer to check against the target's: {exc}") from None
        check_draft_tokenizer(tokenizer, target_tokenizer, where)
    return load_model(path, dtype=dtype)
