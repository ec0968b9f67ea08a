"""Speculative decoding: proposers that guess a sequence's next K tokens cheaply, for the target model to verify
in one step (jaxserve.engine.runner's verify shapes; acceptance on device in jaxserve.engine.sampler.verify).

    ngram    NgramProposer: prompt lookup on the host, no model (jaxserve.spec.ngram)

A proposer's interface, as the scheduler calls it (host side, no jax):

    propose(seq, k) -> tuple[int, ...]     up to k token ids to follow seq.token_ids (possibly none)
"""
