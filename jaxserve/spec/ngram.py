"""N-gram proposals (prompt lookup): the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens, for n from ngram_max down to ngram_min. Host side, no jax.

Each sequence keeps an index per n, {n-gram: end of its most recent occurrence}, extended incrementally with
the n-grams that end at tokens added since its last proposal; a proposal is then at most (ngram_max - ngram_min + 1)
dict lookups, and the per-step cost is a few microseconds whatever the length of the history:

    tokens      a b c d a b c x ... a b c          suffix "a b c" (n = 3), ending at L
    index[3]    {"a b c": 7, ...}                   its most recent earlier occurrence ended at 7
    proposal    tokens[7 : 7 + k]                   "x ..."

The index never holds the suffix itself (it covers n-grams ending before L), so a lookup finds an earlier
occurrence, which may overlap the suffix (a repeating pattern proposes its continuation).
"""

from __future__ import annotations

import weakref


class _SuffixIndex:
    def __init__(self, n_min: int, n_max: int):
        self.sizes = range(n_max, n_min - 1, -1)
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending at positions <= indexed are in the index

    def extend(self, tokens: list[int], upto: int) -> None:
        """Indexes the n-grams ending at indexed + 1 .. upto; later occurrences overwrite earlier ones. The tuples
        are built by zip over shifted slices (C loops), so a long prompt's first index costs little."""
        if upto <= self.indexed:
            return
        for n in self.sizes:
            first, last = max(self.indexed + 1, n) - n, upto - n  # starts of the new n-grams
            if last >= first:
                shifted = [tokens[first + i:last + 1 + i] for i in range(n)]
                self.ends[n].update(zip(zip(*shifted), range(first + n, last + n + 1)))
        self.indexed = upto

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        length = len(tokens)
        self.extend(tokens, length - 1)
        for n in self.sizes:
            if n <= length:
                end = self.ends[n].get(tuple(tokens[length - n:]))
                if end is not None:
                    return tuple(tokens[end:end + k])
        return ()


class NgramProposer:
    """Prompt-lookup proposals for the scheduler (see the module docstring). The index of a sequence lives as long
    as the sequence object (a weak reference), so finished sequences need no clean-up call."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose(self, seq, k: int) -> tuple[int, ...]:
        """Up to k tokens to follow seq.token_ids (all known on the host); () when no suffix occurred before."""
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = _SuffixIndex(self.ngram_min, self.ngram_max)
        return index.propose(seq.token_ids, k)
