"""Speculative decoding: proposers that guess a sequence's next K tokens cheaply, for the target model to verify
in one step (jaxserve.engine.runner's verify shapes; acceptance on device in jaxserve.engine.sampler.verify).

    ngram    NgramProposer: prompt lookup on the host, no model (jaxserve.spec.ngram)
    draft    DeviceProposals: a small model proposes on the device, inside the verify step (jaxserve.spec.draft)

A proposer's interface, as the scheduler calls it (host side, no jax):

    propose(seq, k) -> tuple[int, ...]     up to k token ids to follow seq.token_ids (possibly none; for a draft,
                                           k placeholders the device fills in)
    keeps_cache (optional, bool)           the proposer has a cache of its own that must hold a sequence's tokens
                                           (the scheduler's draft_pass / draft-stale bookkeeping)
"""
