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
    token_sizes: tuple[int, ...]  # T ladder
    seq_sizes: tuple[int, ...]  # S ladder
    page_sizes: tuple[int, ...]  # P ladder

    @classmethod
    def build(cls, max_num_seqs: int, max_num_batched_tokens: int, max_pages: int, *,
              decode_sizes=None, token_sizes=None, seq_sizes=None, context_pages=None) -> "BucketTable":
        """Default ladders: B in powers of two, T in powers of four from 16, S in powers of four from 4,
        P in powers of four from 16 pages (one rung when context_pages=(max_pages,))."""
        decode = decode_sizes or _powers_of_two(1, max_num_seqs)
        tokens = token_sizes or _geometric(min(16, max_num_batched_tokens), max_num_batched_tokens, 4)
        seqs = seq_sizes or _geometric(min(4, max_num_seqs), max_num_seqs, 4)
        pages = context_pages or _geometric(min(16, max_pages), max_pages, 4)
        return cls(tuple(sorted(set(decode))), tuple(sorted(set(tokens))), tuple(sorted(set(seqs))),
                   tuple(sorted(set(min(p, max_pages) for p in pages))))

    def shapes(self) -> list[StepShape]:
        out = [StepShape("decode", b, b, p) for b in self.decode_sizes for p in self.page_sizes]
        out += [StepShape("prefill", t, s, p) for t in self.token_sizes for s in self.seq_sizes
                if s <= t or s == self.seq_sizes[0] for p in self.page_sizes]
        return out

    def decode_shape(self, num_seqs: int, max_pages: int) -> StepShape:
        b = _fit(self.decode_sizes, num_seqs, "decode batch size")
        return StepShape("decode", b, b, _fit(self.page_sizes, max_pages, "pages per sequence"))

    def prefill_shape(self, num_tokens: int, num_seqs: int, max_pages: int) -> StepShape:
        t = _fit(self.token_sizes, num_tokens, "tokens per step")
        s = _fit([s for s in self.seq_sizes if s <= t or s == self.seq_sizes[0]] or self.seq_sizes, num_seqs,
                 f"sequences per step of {t} tokens")
        return StepShape("prefill", t, s, _fit(self.page_sizes, max_pages, "pages per sequence"))

    @property
    def max_seqs(self) -> int:
        return max(self.decode_sizes[-1], self.seq_sizes[-1])


def _fit(ladder, value: int, what: str) -> int:
    i = bisect.bisect_left(ladder, value)
    if i == len(ladder):
        raise BucketError(f"{what} {value} exceeds the largest compiled bucket {ladder[-1]}")
    return ladder[i]


def pages_for(num_tokens: int, page_size: int) -> int:
    return max(1, math.ceil(num_tokens / page_size))
