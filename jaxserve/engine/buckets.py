"""The closed set of step shapes. Every shape is compiled at start-up; a plan that fits none is an error.

    decode[B, P]       B sequences, one new token each, block tables P pages wide
    prefill[T, S, P]   up to T tokens from up to S sequences (prompt chunks and decode tokens mixed)
    verify[T, S, P]    up to K proposals per row, sampled at K + 1 tokens per row (speculative decoding only):
                       prefill's (T, S) pairs, plus ((K + 1) B, B) for the decode sizes B a speculating batch
                       can have, so a pure verify step pads no more than a decode step does

With decode bursts (--decode-burst D > 1), the decode shapes up to --decode-burst-max-batch sequences (and the
smallest one above it, so that such a batch has one) are compiled as bursts: each row runs up to D decode steps
one after another inside the one executable call, a run-time count per row (jaxserve.engine.runner.burst_step),
so bursts add no shape and no executable.

P (pages per block-table row) bounds how much context the XLA attention path gathers; the Pallas kernels read only
the pages a sequence has, so with them the P ladder collapses to one rung.
"""

from __future__ import annotations

import bisect
import dataclasses

from jaxserve.config import ConfigError, EngineConfig


class BucketError(RuntimeError):
    """A step shape outside the compiled table: a bug in the scheduler/engine contract, never a recompile."""


@dataclasses.dataclass(frozen=True)
class StepShape:
    kind: str  # "decode" | "prefill" | "verify"
    tokens: int  # T (== sequences for decode)
    seqs: int  # S
    pages: int  # P

    def __str__(self) -> str:
        if self.kind == "decode":
            return f"decode[B={self.seqs},P={self.pages}]"
        return f"{self.kind}[T={self.tokens},S={self.seqs},P={self.pages}]"


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


def _token_ladder(max_num_batched_tokens: int, fine: bool) -> list[int]:
    coarse = _geometric(min(16, max_num_batched_tokens), max_num_batched_tokens, 4)
    if not fine or max_num_batched_tokens <= FINE_TOKENS_FROM:
        return coarse
    return [t for t in coarse if t < FINE_TOKENS_FROM] + _powers_of_two(FINE_TOKENS_FROM, max_num_batched_tokens)


FINE_TOKENS_FROM = 64  # the CPU's prefill token ladder doubles from here


@dataclasses.dataclass(frozen=True)
class BucketTable:
    decode_sizes: tuple[int, ...]  # B ladder
    prefill_sizes: tuple[tuple[int, int], ...]  # (T, S) pairs, sorted by T then S
    page_sizes: tuple[int, ...]  # P ladder
    num_speculative_tokens: int = 0  # K > 0: the verify family (verify_sizes x P) with K proposals per row
    verify_sizes: tuple[tuple[int, int], ...] = ()  # (T, S) pairs of the verify family, sorted
    burst_tokens: int = 1  # D > 1: decode bursts, up to D steps per row and call (see the module docstring)
    burst_batch: int = 0  # the most sequences a decode burst has (0: no bursts)

    @classmethod
    def build(cls, max_num_seqs: int, max_num_batched_tokens: int, max_pages: int, *,
              decode_sizes=None, token_sizes=None, seq_sizes=None, context_pages=None,
              num_speculative_tokens: int = 0, speculative_batch_size: int | None = None,
              fine_tokens: bool = False, burst_tokens: int = 1, burst_batch: int = 0) -> "BucketTable":
        """Default ladders: B in powers of two; T in powers of four from 16 up to the token budget (`fine_tokens`:
        powers of two from 64 on, see engine_buckets), each with S = min(T, max_num_seqs) (a step never has more
        sequences than tokens); P in powers of four from 16 pages. An explicit S ladder pairs every S with every
        T >= S. `burst_tokens` D > 1: decode bursts of up to `burst_batch` sequences (see the module docstring)."""
        decode = decode_sizes or _powers_of_two(1, max_num_seqs)
        tokens = sorted(set(token_sizes or _token_ladder(max_num_batched_tokens, fine_tokens)))
        if seq_sizes:
            pairs = [(t, s) for t in tokens for s in sorted(set(seq_sizes)) if s <= t or s == min(seq_sizes)]
        else:
            pairs = [(t, min(t, max_num_seqs)) for t in tokens]
        pages = context_pages or _geometric(min(16, max_pages), max_pages, 4)
        verify = []
        if num_speculative_tokens:
            short = [b for b in decode if speculative_batch_size is None or b <= speculative_batch_size]
            verify = pairs + [((num_speculative_tokens + 1) * b, b) for b in short
                              if (num_speculative_tokens + 1) * b < max(t for t, _ in pairs)]
        bursts = burst_tokens > 1 and burst_batch > 0
        return cls(tuple(sorted(set(decode))), tuple(sorted(set(pairs))),
                   tuple(sorted(set(min(p, max_pages) for p in pages))), num_speculative_tokens,
                   tuple(sorted(set(verify))), burst_tokens if bursts else 1, burst_batch if bursts else 0)

    def shapes(self) -> list[StepShape]:
        out = [StepShape("decode", b, b, p) for b in self.decode_sizes for p in self.page_sizes]
        out += [StepShape("prefill", t, s, p) for t, s in self.prefill_sizes for p in self.page_sizes]
        out += [StepShape("verify", t, s, p) for t, s in self.verify_sizes for p in self.page_sizes]
        return out

    def largest_shapes(self) -> list[StepShape]:
        """The largest shape of each family (most tokens, then sequences, then pages): where the executables'
        temporaries peak, as jaxserve.engine.memory measures them before sizing the KV cache."""
        shapes = self.shapes()
        kinds = ("decode", "prefill", "verify") if self.num_speculative_tokens else ("decode", "prefill")
        return [max((s for s in shapes if s.kind == kind), key=lambda s: (s.tokens, s.seqs, s.pages))
                for kind in kinds]

    def check_covers(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                     page_size: int) -> None:
        """Raises ConfigError, before anything compiles, unless every plan the scheduler can make has a shape:

            decode     1..max_num_seqs sequences
            prefill    t = 1..max_num_batched_tokens tokens from up to min(t, max_num_seqs) sequences
            pages      up to ceil(max_model_len / page_size) per sequence, in either family
        """
        if self.decode_sizes[-1] < max_num_seqs:
            raise ConfigError(_missing("--decode-buckets", self.decode_sizes, f"{max_num_seqs} sequences",
                                       f"max_num_seqs {max_num_seqs}", max_num_seqs))
        max_pages = -(-max_model_len // page_size)
        if self.page_sizes[-1] < max_pages:
            have = tuple(p * page_size for p in self.page_sizes)
            raise ConfigError(_missing("--context-buckets", have, f"a context of {max_model_len} tokens "
                                       f"({max_pages} pages of {page_size})", f"max_model_len {max_model_len}",
                                       max_model_len))
        largest_t = max(t for t, _ in self.prefill_sizes)
        if largest_t < max_num_batched_tokens:
            tokens = tuple(sorted({t for t, _ in self.prefill_sizes}))
            raise ConfigError(_missing("--prefill-token-buckets", tokens, f"{max_num_batched_tokens} tokens",
                                       f"max_num_batched_tokens {max_num_batched_tokens}", max_num_batched_tokens))
        for t in range(1, max_num_batched_tokens + 1):
            s = min(t, max_num_seqs)
            if not any(bt >= t and bs >= s for bt, bs in self.prefill_sizes):
                seqs = tuple(sorted({bs for _, bs in self.prefill_sizes}))
                raise ConfigError(_missing("--prefill-seq-buckets", seqs, f"a step of {t} tokens from {s} sequences",
                                           f"max_num_seqs {max_num_seqs}", min(max_num_seqs, max_num_batched_tokens))
                                  + " (each S pairs with the token buckets T >= S)")

    def decode_shape(self, num_seqs: int, max_pages: int) -> StepShape:
        b = _fit(self.decode_sizes, num_seqs, "decode batch size")
        return StepShape("decode", b, b, _fit(self.page_sizes, max_pages, "pages per sequence"))

    def bursts(self, shape: StepShape) -> bool:
        """The shape's executable runs decode bursts (a step count per row)."""
        return (shape.kind == "decode" and self.burst_tokens > 1
                and shape.seqs <= _fit(self.decode_sizes, min(self.burst_batch, self.decode_sizes[-1]), "batch"))

    def prefill_shape(self, num_tokens: int, num_seqs: int, max_pages: int) -> StepShape:
        return _ragged_shape("prefill", self.prefill_sizes, num_tokens, num_seqs,
                             _fit(self.page_sizes, max_pages, "pages per sequence"))

    def verify_shape(self, num_tokens: int, num_seqs: int, max_pages: int) -> StepShape:
        if not self.verify_sizes:
            raise BucketError("a plan with proposals, but this table has no verify shapes (no speculation)")
        return _ragged_shape("verify", self.verify_sizes, num_tokens, num_seqs,
                             _fit(self.page_sizes, max_pages, "pages per sequence"))


def _ragged_shape(kind: str, sizes, num_tokens: int, num_seqs: int, pages: int) -> StepShape:
    fitting = [(t, s) for t, s in sizes if t >= num_tokens and s >= num_seqs]
    if not fitting:
        raise BucketError(f"a step of {num_tokens} tokens from {num_seqs} sequences fits no compiled bucket "
                          f"(largest: {sizes[-1]})")
    t, s = fitting[0]
    return StepShape(kind, t, s, pages)


def engine_buckets(config: EngineConfig, max_model_len: int, attention_name: str) -> BucketTable:
    """The engine's table from its config, checked to cover every plan the scheduler can make (verify shapes
    when speculative decoding is on). On the CPU (the C++ attention kernel) a prompt step costs what its padded
    tokens cost, so its token ladder doubles from 64 instead of quadrupling: a 128-token prompt ran padded to 256
    tokens (174 against 100 ms for the small Llama's projections in XLA, 2 cores)."""
    max_pages = -(-max_model_len // config.page_size)
    context = config.context_buckets and tuple(-(-t // config.page_size) for t in config.context_buckets)
    if attention_name == "pallas" and not context:
        context = (max_pages,)  # the kernels read only the pages a sequence has
    table = BucketTable.build(config.max_num_seqs, config.max_num_batched_tokens, max_pages,
                              decode_sizes=config.decode_buckets, token_sizes=config.prefill_token_buckets,
                              seq_sizes=config.prefill_seq_buckets, context_pages=context,
                              num_speculative_tokens=config.num_speculative_tokens if config.speculative_method else 0,
                              speculative_batch_size=config.speculative_disable_batch_size,
                              fine_tokens=attention_name == "cpu",
                              burst_tokens=config.resolved_decode_burst(cpu=attention_name == "cpu"),
                              burst_batch=config.decode_burst_max_batch)
    table.check_covers(config.max_num_seqs, config.max_num_batched_tokens, max_model_len, config.page_size)
    return table


def _missing(flag: str, ladder, what: str, limit: str, add: int) -> str:
    return f"{flag} {','.join(map(str, ladder))} has no bucket for {what} ({limit}): add {add}"


def _fit(ladder, value: int, what: str) -> int:
    i = bisect.bisect_left(ladder, value)
    if i == len(ladder):
        raise BucketError(f"{what} {value} exceeds the largest compiled bucket {ladder[-1]}")
    return ladder[i]
