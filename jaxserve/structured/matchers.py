"""Per-sequence grammar state on the engine's host side, and the token bitmask the sampler applies on device.

    add(request)          one matcher per sample (n of them), copied from the compiled grammar
    disallowed(rows)      [rows, ceil(vocab / 32)] int32: bit t of row r set = token t may not be sampled there;
                          all-zero rows (unconstrained, or rows that do not sample) change nothing
    accept(id, i, token)  advances sample i's matcher with the token the step sampled
    drop(id[, i])         forgets finished samples

Pipelining: the mask for a sequence's next token needs the token before it. In a pure decode step a constrained
sequence still runs one step ahead: the engine dispatches the step's forward pass, reads the previous step's
tokens, advances the matchers, and only then makes the masks and dispatches the sampling half (the split decode
executables, jaxserve.engine.runner), so the device computes step N + 1's forward pass while the host reads step
N. A step with prompt work (prefill shapes have no split form) does not plan a constrained sequence whose last
token is still on the device; its mask is made when it is planned.

Preemption needs no rollback: a preempted sequence keeps its tokens and is recomputed from them, and its
matcher has seen exactly those tokens.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np

from jaxserve.structured.grammar import GrammarCompiler

log = logging.getLogger(__name__)
PARALLEL_MIN_ROWS, PARALLEL_MIN_CPUS = 64, 8  # below either, masks are filled in turn (see _fill)


class StructuredOutputs:
    """The engine core's grammar matchers, keyed (request id, sample index). Engine thread only, except
    `compiler`, which is thread-safe."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._matchers: dict[tuple[str, int], object] = {}
        self._executor = None

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, params) -> None:
        """Compiles (or finds cached) the request's constraint and gives each of its params.n samples a matcher.
        Raises InvalidRequestError for a constraint that does not compile; nothing is kept then."""
        grammar = self.compiler.compile(params.structured_outputs)
        for index in range(params.n):
            self._matchers[(request_id, index)] = grammar.matcher()

    def is_constrained(self, request_id: str, index: int) -> bool:
        return (request_id, index) in self._matchers

    def accept(self, request_id: str, index: int, token_id: int) -> None:
        matcher = self._matchers.get((request_id, index))
        if matcher is not None and not matcher.consume_token(token_id):
            # Only reachable if the device sampled outside the mask; the matcher now allows nothing but EOS.
            log.warning("request %s sample %d: token %d rejected by its grammar: %s", request_id, index, token_id,
                        matcher.get_error())

    def drop(self, request_id: str, index: int | None = None) -> None:
        if index is not None:
            self._matchers.pop((request_id, index), None)
            return
        for key in [key for key in self._matchers if key[0] == request_id]:
            del self._matchers[key]

    def disallowed(self, rows: Sequence[tuple[str, int, bool]], vocab_size: int) -> np.ndarray | None:
        """The step's bitmask for rows (request id, sample index, samples this step), or None when no sampling
        row is constrained. Row r bit t set: token t is not allowed for row r."""
        wanted = [(i, self._matchers[(rid, index)]) for i, (rid, index, samples) in enumerate(rows)
                  if samples and (rid, index) in self._matchers]
        if not wanted:
            return None
        words = (vocab_size + 31) // 32
        allowed = np.zeros((len(wanted), self.compiler.mask_words), np.int32)
        self._fill(wanted, allowed)
        out = np.zeros((len(rows), words), np.int32)
        common = min(words, allowed.shape[1])
        out[[i for i, _ in wanted], :common] = ~allowed[:, :common]
        if words > common:  # ids past the tokenizer's vocabulary
            out[[i for i, _ in wanted], common:] = -1
        return out

    def _fill(self, wanted: list[tuple[int, object]], allowed: np.ndarray) -> None:
        """One matcher after the other (~5-10 µs each): llguidance's thread pool (LLExecutor) took 17 ms for 16
        rows on a loaded 2-core machine, against 0.2 ms in turn; it is used only for large batches on many cores."""
        import llguidance
        import llguidance.numpy as llnp
        if len(wanted) < PARALLEL_MIN_ROWS or (os.cpu_count() or 1) < PARALLEL_MIN_CPUS:
            for j, (_, matcher) in enumerate(wanted):
                llnp.fill_next_token_bitmask(matcher, allowed, j)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llnp.fill_next_token_bitmask_par(self._executor, [(m, j) for j, (_, m) in enumerate(wanted)], allowed)
