"""The closed set of step shapes. Every shape is compiled at start-up; a plan that fits none is an error.

    decode[B, P]       B sequences, one new token each, block tables P pages wide
    prefill[T, S, P]   up to T tokens from up to S sequences (prompt chunks and decode tokens mixed)

P (pages per block-table row) bounds how much context the XLA attention path gathers; the Pallas kernels read only
the pages a sequence has, so with them the P ladder collapses to one rung.
"""

from __future__ import annotations

import bisect
import dataclasses
import math


class BucketError(RuntimeError):
    """A step shape outside the compiled table: a bug in the scheduler/engine contract, never a recompile."""


@dataclasses.dataclass(frozen=True)
class StepShape:
    kind: str  # "decode" | "prefill"
    tokens: int  # T (== sequences for decode)
    seqs: int  # S
    pages: int  # P

    def __str__(self) -> str:
        if self.kind == "decode":
            return f"decode[B={self.seqs},P={self.pages}]"
        return f"prefill[T={self.tokens},S={self.seqs},P={self.pages}]"


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    return out + [hi]


def _geometric(lo: int, hi: int, ratio: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= ratio
    return out + [hi]


@dataclasses.dataclass(frozen=True)
class BucketTable:
    decode_sizes: tuple[int, ...]  # B ladder
    prefill_sizes: tuple[tuple[int, int], ...]  # (T, S) pairs, sorted by T then S
    page_sizes: tuple[int, ...]  # P ladder

    @classmethod
    def build(cls, max_num_seqs: int, max_num_batched_tokens: int, max_pages: int, *,
              decode_sizes=None, token_sizes=None, seq_sizes=None, context_pages=None) -> "BucketTable":
        """Default ladders: B in powers of two; T in powers of four from 16 up to the token budget, each with
        S = min(T, max_num_seqs) (a step never has more sequences than tokens); P in powers of four from 16
        pages. An explicit S ladder pairs every S with every T >= S."""
        decode = decode_sizes or _powers_of_two(1, max_num_seqs)
        tokens = sorted(set(token_sizes or _geometric(min(16, max_num_batched_tokens), max_num_batched_tokens, 4)))
        if seq_sizes:
            pairs = [(t, s) for t in tokens for s in sorted(set(seq_sizes)) if s <= t or s == min(seq_sizes)]
        else:
            pairs = [(t, min(t, max_num_seqs)) for t in tokens]
        pages = context_pages or _geometric(min(16, max_pages), max_pages, 4)
        return cls(tuple(sorted(set(decode))), tuple(sorted(set(pairs))),
                   tuple(sorted(set(min(p, max_pages) for p in pages))))

    def shapes(self) -> list[StepShape]:
        out = [StepShape("decode", b, b, p) for b in self.decode_sizes for p in self.page_sizes]
        out += [StepShape("prefill", t, s, p) for t, s in self.prefill_sizes for p in self.page_sizes]
        return out

    def decode_shape(self, num_seqs: int, max_pages: int) -> StepShape:
        b = _fit(self.decode_sizes, num_seqs, "decode batch size")
        return StepShape("decode", b, b, _fit(self.page_sizes, max_pages, "pages per sequence"))

    def prefill_shape(self, num_tokens: int, num_seqs: int, max_pages: int) -> StepShape:
        fitting = [(t, s) for t, s in self.prefill_sizes if t >= num_tokens and s >= num_seqs]
        if not fitting:
            raise BucketError(f"a step of {num_tokens} tokens from {num_seqs} sequences fits no compiled bucket "
                              f"(largest: {self.prefill_sizes[-1]})")
        t, s = fitting[0]
        return StepShape("prefill", t, s, _fit(self.page_sizes, max_pages, "pages per sequence"))


def _fit(ladder, value: int, what: str) -> int:
    i = bisect.bisect_left(ladder, value)
    if i == len(ladder):
        raise BucketError(f"{what} {value} exceeds the largest compiled bucket {ladder[-1]}")
    return ladder[i]


def pages_for(num_tokens: int, page_size: int) -> int:
    return max(1, math.ceil(num_tokens / page_size))
