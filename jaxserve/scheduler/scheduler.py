"""Continuous-batching scheduler: which sequences advance by how many tokens in the next step. No jax.

There is no prefill phase and no decode phase. Each sequence has `num_computed_tokens` and a number of tokens it
has; every step spends a token budget (`max_num_batched_tokens`) on them:

    1. running sequences that need one token (decodes), oldest first — a long prompt never stalls them;
    2. running sequences still in their prompt, a chunk each from what is left of the budget;
    3. waiting sequences, in (priority, arrival) order, after a prefix-cache lookup, while the budget, the
       sequence limit and the free pages allow.

When a running sequence needs a page and none is free, the lowest-priority running sequence not yet in this step
is preempted: its pages are freed (full ones stay findable in the prefix cache) and it goes back to waiting, to be
recomputed later. Nothing is admitted in a step that preempted.

The plan goes to the engine; `update()` takes the step's sampled tokens back. The engine may dispatch the next
plan before the previous result is back (one step ahead), so sampled tokens can be "pending" for a while.

Speculative decoding (a `proposer` and num_speculative_tokens K > 0): a decoding sequence whose tokens are all
back on the host gets up to K proposed tokens and runs K + 1 query tokens (its last token + the proposals):

    before        token_ids = t[0..L-1], num_computed = L - 1
    step          queries at positions L-1 .. L-1+k (pages for L + k tokens), context_len = L + k
    in flight     num_computed = L, one pending token, num_speculated = k: not scheduled until it is back
    update        a accepted proposals + 1 token from the target: token_ids += a + 1, num_computed = L + a;
                  the K/V written for rejected proposals is overwritten later, pages past the need go back

While speculation is on for a step (at most speculative_disable_batch_size running sequences), decoding
sequences wait for their pending tokens rather than run one step ahead: a proposal needs the newest token.

A draft model (a proposer with `keeps_cache`, jaxserve.spec.draft) needs its own cache to hold every token before
a sequence's newest. Its forward pass runs only in speculating steps (`StepPlan.draft_pass`): above the disable
batch size a large batch pays nothing for it. A sequence scheduled in a step without it is "draft-stale" and never
proposes again, and the pages that step wrote are marked as missing the draft's K/V; a sequence that takes such a
page from the prefix cache (or from its fork leader) is draft-stale too. A page freshly written with the draft's
pass by a sequence that is not stale is whole again.

Decode bursts (decode_burst D > 1): while every running sequence decodes, nothing waits, no sequence is
constrained and at most decode_burst_max_batch run, each decoding sequence runs up to D steps one after another
in one executable call, each step's input the token the previous one sampled (on the device):

    before        num_tokens = N (pending ones included), num_computed = N - 1
    step          c = min(D, max_len - N) steps: queries at positions N-1 .. N+c-2 (pages for N + c - 1 tokens)
    in flight     num_computed = N + c - 1, c pending tokens: the next step may run one ahead, as after a decode
    update        the c tokens, cut at the first that ends the sequence

Structured output: a constrained sequence's next mask needs its newest token. With `late_masks` (the engine has
split decode executables) it still runs one step ahead in a step with no prompt work, and the plan says
`late_mask`: the engine sends the forward pass first and the masked sampling once the token is read. In any other
step it waits for its pending token.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
import time
from typing import Iterable, Sequence as Seq

from jaxserve.kv.allocator import PageAllocator, adapter_salt, page_hashes
from jaxserve.lora.slots import AdapterSlots
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.sequence import Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    num_speculative_tokens: int = 0  # K: proposals per speculating sequence and step (0: no speculation)
    speculative_disable_batch_size: int | None = None  # no speculation with more running sequences
    # a constrained sequence may decode while its last token is in flight, its mask sent after the forward pass
    # (the engine's split decode executables); only in steps with no prompt work, whose shape is a decode shape
    late_masks: bool = False
    decode_burst: int = 1  # D: steps per decoding sequence in a decode burst (1: no bursts)
    decode_burst_max_batch: int = 0  # no bursts with more running sequences

    @property
    def num_slots(self) -> int:
        """Device slots: one per running sequence, plus the null slot 0."""
        return self.max_num_seqs + 1


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One row of a step: everything the engine needs about the sequence, so it never looks one up."""

    seq_id: int
    request_id: str
    index: int  # the sample within its request
    params: SamplingParams
    slot: int
    num_new_tokens: int
    context_len: int  # tokens in the cache after this step
    sample: bool  # this chunk ends at the sequence's last token: the step samples its next token
    pages: tuple[int, ...]  # the sequence's pages (its block-table row)
    prompt_logprobs: bool  # score this chunk's prompt tokens
    draft_token_ids: tuple[int, ...] = ()  # proposals: the last num_draft_tokens query tokens (verify rows)
    lora_slot: int = 0  # device slot of the sequence's LoRA adapter (0 = none)
    burst: int = 1  # tokens sampled one after another (a decode burst: then num_new_tokens == burst)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)


@dataclasses.dataclass(frozen=True)
class SlotAssignment:
    """A sequence entering a device slot: the device learns its tokens and sampling parameters."""

    slot: int
    seq_id: int
    request_id: str
    index: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
    step_id: int
    seqs: tuple[ScheduledSequence, ...]
    new_slots: tuple[SlotAssignment, ...]
    num_tokens: int
    waiting_for_pages: bool = False  # a sequence was preempted, or a waiting one not admitted, for lack of pages
    lora_loads: tuple[tuple[int, int], ...] = ()  # (slot, adapter id): adapters to write before this step runs
    late_mask: bool = False  # a constrained row's last token is in flight: its mask is made after it is read
    draft_pass: bool = False  # the draft model's forward pass runs in this step (speculative decoding)

    @property
    def is_decode(self) -> bool:
        return all(s.num_new_tokens == s.burst and s.sample for s in self.seqs)

    @property
    def burst(self) -> int:
        """Decode steps per row in the step's call: 1, or a decode burst's most."""
        return max((s.burst for s in self.seqs), default=1)

    @property
    def is_burst(self) -> bool:
        """A decode burst: each row decodes `burst` steps in a row, inside one executable call."""
        return self.burst > 1

    @property
    def is_verify(self) -> bool:
        """Some row carries proposals: the step samples at each of their positions and accepts on device."""
        return any(s.draft_token_ids for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """One scheduled row's result, as the engine read it back."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class SequenceUpdate:
    """What update() did to a sequence: its new tokens (one, or accepted proposals + one on a verify step; none
    past the one that ended it), and its finish if a token ended it."""

    request_id: str
    index: int
    tokens: tuple[SampledToken, ...]
    finish_reason: str | None = None
    stop_reason: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class SpeculationCounts:
    """Verify rows applied since start-up (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # rows that carried proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [i]: proposal i accepted

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


class Scheduler:
    """`proposer` (speculative decoding, see the module docstring): `propose(seq, k) -> tuple[int, ...]`, up to k
    tokens to follow seq.token_ids, e.g. jaxserve.spec.ngram.NgramProposer."""

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, eos_token_ids: Iterable[int] = (),
                 clock=time.monotonic, seed: int = 0, proposer=None, adapter_slots: AdapterSlots | None = None):
        self.config = config
        self.proposer = proposer if config.num_speculative_tokens > 0 else None
        self.speculation = SpeculationCounts()
        self.allocator = allocator
        self.adapter_slots = adapter_slots  # LoRA: which adapter holds which device slot (None: no LoRA)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.waiting: list[Sequence] = []  # sorted by queue_key
        self.running: list[Sequence] = []
        self.sequences: dict[int, Sequence] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self._held_forks: dict[int, list[Sequence]] = {}  # leader seq_id -> siblings waiting for its prompt
        self._free_slots = list(range(config.num_slots - 1, 0, -1))
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._rng = random.Random(seed)  # seeds for requests that bring none
        self.num_preemptions = 0
        self._keeps_draft_cache = bool(getattr(self.proposer, "keeps_cache", False))
        self._pages_without_draft: set[int] = set()  # some token's draft K/V was never written (see above)
        self._draft_pass = False  # the step being scheduled runs the draft's forward pass

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, lora_id: int = 0) -> list[Sequence]:
        """Queues a validated request (jaxserve.validation) as params.n sequences, run with LoRA adapter
        `lora_id` (0: none)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_id and self.adapter_slots is None:
            raise ValueError("this scheduler has no LoRA adapter slots")
        prompt = list(prompt_token_ids)
        max_len = self._max_len(len(prompt), params)
        arrival = self.clock() if arrival_time is None else arrival_time
        seqs = [Sequence(next(self._seq_ids), request_id, i, params, list(prompt), len(prompt), max_len,
                         self._seed(params, i), arrival, priority, lora_id=lora_id) for i in range(params.n)]
        self.requests[request_id] = seqs
        for seq in seqs:
            self.sequences[seq.seq_id] = seq
        self._enqueue(seqs[0])
        if len(seqs) > 1:
            for sibling in seqs[1:]:
                sibling.fork_parent = seqs[0]
            self._held_forks[seqs[0].seq_id] = seqs[1:]
        return seqs

    def _max_len(self, prompt_len: int, params: SamplingParams) -> int:
        """The sequence's length limit. Requests were validated on entry (jaxserve.validation.validate_request):
        1 <= prompt_len < max_model_len and prompt_len + max_tokens <= max_model_len."""
        if params.max_tokens is None:
            return self.config.max_model_len
        return prompt_len + params.max_tokens

    def _seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return self._rng.getrandbits(31)
        return (params.seed + 0x9E3779B1 * index) % (2**31)

    def abort_request(self, request_id: str) -> list[int]:
        """Finishes every unfinished sequence of the request with "abort" and frees what they hold; returns their
        sample indices. Unknown ids: no-op."""
        unfinished = [seq for seq in self.requests.get(request_id, []) if not seq.is_finished]
        for seq in unfinished:
            self.finish(seq, "abort")
        return [seq.index for seq in unfinished]

    def fail_request(self, request_id: str) -> None:
        """Ends a request whose last step may not have run (it failed): like abort_request, except that pages
        computed in that step are not offered to the prefix cache (their K/V may never have been written)."""
        for seq in self.requests.get(request_id, []):
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_registered_pages * self.config.page_size)
        self.abort_request(request_id)

    def finish_sample(self, request_id: str, index: int, reason: str, stop_reason: str | int | None = None) -> bool:
        """Finishes one sample of a request (a stop string ended it); True if the whole request is now over."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return False
        self.finish(seqs[index], reason, stop_reason)
        return request_id not in self.requests

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.allocator.free(seq.pages)  # a released fork waits holding the prompt pages it shares
            seq.pages, seq.num_registered_pages, seq.num_computed_tokens = [], 0, 0
        self._drop_held_forks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if all(s.is_finished for s in self.requests[seq.request_id]):
            for s in self.requests.pop(seq.request_id):
                self.sequences.pop(s.seq_id, None)

    def _drop_held_forks(self, seq: Sequence) -> None:
        """A leader that ends before its prompt is computed hands the prompt to its first held sibling."""
        siblings = self._held_forks.pop(seq.seq_id, [])
        if siblings and seq.finish_reason is None and seq.num_computed_tokens < seq.num_prompt_tokens:
            leader, rest = siblings[0], siblings[1:]
            leader.fork_parent = None
            self._enqueue(leader)
            if rest:
                for s in rest:
                    s.fork_parent = leader
                self._held_forks[leader.seq_id] = rest

    @property
    def has_requests(self) -> bool:
        """Some request has a sequence that has not finished (it may wait for its sibling's prompt)."""
        return bool(self.requests)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(v) for v in self._held_forks.values())

    # ---- scheduling -----------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        scheduled: dict[int, ScheduledSequence] = {}
        new_slots: list[SlotAssignment] = []
        speculating = self.speculating
        self._draft_pass = self._keeps_draft_cache and speculating
        preempted, late_mask = self._schedule_running(budget, scheduled, speculating)
        out_of_pages = preempted or self._schedule_waiting(budget, scheduled, new_slots)
        plan_seqs = tuple(scheduled.values())
        loads = self.adapter_slots.take_loads() if self.adapter_slots is not None else ()
        if self._keeps_draft_cache:
            self._track_draft_pages(plan_seqs, self._draft_pass)
        return StepPlan(next(self._step_ids), plan_seqs, tuple(new_slots), sum(s.num_new_tokens for s in plan_seqs),
                        out_of_pages, loads, late_mask, self._draft_pass)

    def _track_draft_pages(self, rows: tuple[ScheduledSequence, ...], draft_pass: bool) -> None:
        """Which pages the draft model's cache holds whole, after a step with or without its forward pass."""
        page_size = self.config.page_size
        for row in rows:
            seq = self.sequences[row.seq_id]
            written = row.pages[(row.context_len - row.num_new_tokens) // page_size:
                                -(-row.context_len // page_size)]
            if draft_pass and not seq.draft_stale:
                self._pages_without_draft.difference_update(written)
            else:
                seq.draft_stale = True
                self._pages_without_draft.update(written)

    def _inherits_draft_gap(self, pages: Seq[int]) -> bool:
        return self._keeps_draft_cache and not self._pages_without_draft.isdisjoint(pages)

    @property
    def speculating(self) -> bool:
        """The next step proposes tokens (a proposer, and at most speculative_disable_batch_size running
        sequences): the engine reads every result back before planning it."""
        limit = self.config.speculative_disable_batch_size
        return self.proposer is not None and (limit is None or len(self.running) <= limit)

    def _schedule_running(self, budget: "_Budget", scheduled: dict[int, ScheduledSequence],
                          speculating: bool = False) -> tuple[bool, bool]:
        """Decodes, then running prompts' chunks. Returns (a sequence was preempted, a constrained sequence
        decodes with its last token in flight: the plan's masks come late)."""
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        chunks = [s for s in self.running if s.num_uncomputed_tokens > 1]
        # a late mask needs a pure decode step: no prompt chunk, nobody admitted (nor asking to be)
        late_ok = (self.config.late_masks and not speculating and not chunks
                   and (self.num_waiting == 0 or len(self.running) >= self.config.max_num_seqs))
        preempted = late_mask = False
        burst = self._burst_length(decodes, chunks, speculating)
        for seq in decodes + chunks:
            if seq.status is not SequenceStatus.RUNNING or not budget.has_room():
                continue
            if seq.num_tokens >= seq.max_len:
                continue  # its pending token is its last one
            if seq.num_pending_tokens and seq.params.structured_outputs is not None:
                if not late_ok:
                    continue  # its grammar needs that token before the next mask (jaxserve.structured.matchers)
            if seq.num_speculated or (speculating and seq.num_pending_tokens):
                continue  # how many tokens its verify step accepts, or the token a proposal needs, is not back
            proposes = speculating and seq.num_uncomputed_tokens == 1 and not seq.draft_stale
            drafts = self._propose(seq, budget) if proposes else ()
            num_new = min(seq.num_uncomputed_tokens, budget.tokens) + len(drafts)
            steps = min(burst, seq.max_len - seq.num_tokens, budget.tokens)
            num_new = steps if steps > 1 else num_new
            while not self._grow_pages(seq, seq.num_computed_tokens + num_new):
                preempted = True
                victim = self._pick_victim(scheduled)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                late_mask |= bool(seq.num_pending_tokens and seq.params.structured_outputs is not None)
                scheduled[seq.seq_id] = (self._advance_burst(seq, steps, budget) if steps > 1
                                         else self._advance(seq, num_new, budget, drafts))
        return preempted, late_mask

    def _burst_length(self, decodes: list[Sequence], chunks: list[Sequence], speculating: bool) -> int:
        """Steps per decoding sequence in this plan: decode_burst when it may burst (see the module docstring:
        no prompt work, nobody waiting, no grammar, a small batch), else 1."""
        config = self.config
        if (config.decode_burst <= 1 or speculating or chunks or self.num_waiting
                or not 0 < len(self.running) <= config.decode_burst_max_batch):
            return 1
        for seq in decodes:
            if seq.params.structured_outputs is not None:
                return 1  # each of its tokens needs the host's grammar before the next mask
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                return 1  # its last prompt token is still to run (with its prompt logprobs, its forks)
        return config.decode_burst

    def _propose(self, seq: Sequence, budget: "_Budget") -> tuple[int, ...]:
        """Proposals for a decoding sequence: at most K, at most what the budget leaves beside its own token, and
        never more than max_len allows (a + 1 new tokens for a accepted proposals)."""
        k = min(self.config.num_speculative_tokens, budget.tokens - 1, seq.max_len - seq.num_tokens - 1)
        return tuple(self.proposer.propose(seq, k))[:k] if k > 0 else ()

    def _schedule_waiting(self, budget: "_Budget", scheduled: dict[int, ScheduledSequence],
                          new_slots: list[SlotAssignment]) -> bool:
        """Admits waiting sequences in queue order; True if one had to stay waiting for lack of KV pages."""
        index = 0
        while index < len(self.waiting) and budget.has_room() and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[index]
            if seq.num_pending_tokens or not self._adapter_available(seq):
                index += 1  # preempted while a step was in flight (wait for its token), or its adapter waits
                continue  # for a device slot: later requests may go first
            if not self._admit(seq, budget):
                return True
            self.waiting.pop(index)
            new_slots.append(SlotAssignment(seq.slot, seq.seq_id, seq.request_id, seq.index, tuple(seq.token_ids),
                                            seq.num_prompt_tokens, seq.params, seq.seed))
            scheduled[seq.seq_id] = self._advance(seq, min(seq.num_uncomputed_tokens, budget.tokens), budget)
        return False

    def _admit(self, seq: Sequence, budget: "_Budget") -> bool:
        """Gives a waiting sequence cached prefix pages, pages for its first chunk and a slot; False if no room."""
        page_size = self.config.page_size
        if not seq.pages:
            seq.page_hashes = page_hashes(seq.token_ids, page_size, seq.page_hashes, adapter_salt(seq.lora_id))
            reusable = 0 if seq.wants_prompt_logprobs else (len(seq.token_ids) - 1) // page_size
            seq.pages = self.allocator.lookup_prefix(seq.page_hashes, reusable)
            seq.num_registered_pages = len(seq.pages)
            seq.num_computed_tokens = len(seq.pages) * page_size
            seq.draft_stale = self._inherits_draft_gap(seq.pages)  # recomputed from here: whole again otherwise
        num_new = min(seq.num_uncomputed_tokens, budget.tokens)
        if not self._grow_pages(seq, seq.num_computed_tokens + num_new):
            self.allocator.free(seq.pages)
            seq.pages, seq.num_registered_pages, seq.num_computed_tokens = [], 0, 0
            return False
        seq.status = SequenceStatus.RUNNING
        seq.slot = self._free_slots.pop()
        if seq.lora_id:
            seq.lora_slot = self.adapter_slots.acquire(seq.lora_id)
        self.running.append(seq)
        return True

    def _adapter_available(self, seq: Sequence) -> bool:
        return not seq.lora_id or self.adapter_slots.can_acquire(seq.lora_id)

    def num_sequences_with_adapter(self, lora_id: int) -> int:
        """Unfinished sequences (running or waiting) that run with adapter `lora_id`."""
        return sum(1 for seq in self.sequences.values() if seq.lora_id == lora_id and not seq.is_finished)

    def _advance(self, seq: Sequence, num_new: int, budget: "_Budget",
                 drafts: tuple[int, ...] = ()) -> ScheduledSequence:
        """Spends the budget on the sequence's next num_new query tokens; with proposals (the last len(drafts) of
        them), only its own token counts as computed until the verify step's result is back."""
        budget.spend(num_new)
        seq.num_computed_tokens += num_new - len(drafts)
        seq.num_speculated = len(drafts)
        sample = seq.num_computed_tokens == seq.num_tokens
        if sample:
            seq.num_pending_tokens += 1
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            self._release_forks(seq)
        first = seq.num_computed_tokens - (num_new - len(drafts))  # position of the chunk's first token
        prompt_logprobs = seq.wants_prompt_logprobs and first < seq.num_prompt_tokens
        return ScheduledSequence(seq.seq_id, seq.request_id, seq.index, seq.params, seq.slot, num_new,
                                 seq.num_computed_tokens + len(drafts), sample, tuple(seq.pages), prompt_logprobs,
                                 drafts, seq.lora_slot)

    def _advance_burst(self, seq: Sequence, steps: int, budget: "_Budget") -> ScheduledSequence:
        """A decoding sequence's burst of `steps` decode steps: each step's input token is the one sampled before
        it on the device, so every one of them counts as computed, and all the sampled tokens as pending."""
        budget.spend(steps)
        seq.num_computed_tokens += steps
        seq.num_pending_tokens += steps
        return ScheduledSequence(seq.seq_id, seq.request_id, seq.index, seq.params, seq.slot, steps,
                                 seq.num_computed_tokens, True, tuple(seq.pages), False, (), seq.lora_slot, steps)

    def _release_forks(self, leader: Sequence) -> None:
        """Siblings of a request share the leader's full prompt pages and recompute only the remainder."""
        siblings = self._held_forks.pop(leader.seq_id, [])
        shared = leader.pages[:(leader.num_prompt_tokens - 1) // self.config.page_size]
        for sibling in siblings:
            self.allocator.share(shared)
            sibling.pages = list(shared)
            sibling.page_hashes = list(leader.page_hashes[:len(shared)])
            sibling.num_registered_pages = min(leader.num_registered_pages, len(shared))
            sibling.num_computed_tokens = len(shared) * self.config.page_size
            # the leader's last prompt chunk may be in this very step: whole only if the step has the draft's pass
            sibling.draft_stale = self._keeps_draft_cache and (leader.draft_stale or not self._draft_pass)
            sibling.fork_parent = None
            self._enqueue(sibling)

    def _grow_pages(self, seq: Sequence, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.config.page_size) - len(seq.pages)
        if needed <= 0:
            return True
        if not self.allocator.can_allocate(needed):
            return False
        seq.pages.extend(self.allocator.allocate(needed))
        return True

    def _pick_victim(self, scheduled: dict[int, ScheduledSequence]) -> Sequence:
        candidates = [s for s in self.running if s.seq_id not in scheduled]
        return max(candidates, key=Sequence.queue_key)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)

    def _release(self, seq: Sequence) -> None:
        """Returns pages (full known ones stay in the prefix cache) and the slot."""
        self._register_full_pages(seq)
        self.allocator.free(seq.pages)
        seq.pages, seq.num_registered_pages, seq.num_computed_tokens = [], 0, 0
        self._free_slots.append(seq.slot)
        seq.slot = 0
        if seq.lora_id:
            self.adapter_slots.release(seq.lora_id)
            seq.lora_slot = 0

    def _register_full_pages(self, seq: Sequence) -> None:
        """Indexes the pages whose tokens are all known on the host and whose K/V are (being) computed."""
        page_size = self.config.page_size
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // page_size
        if num_full <= seq.num_registered_pages:
            return
        seq.page_hashes = page_hashes(seq.token_ids[:num_full * page_size], page_size, seq.page_hashes[:num_full],
                                      adapter_salt(seq.lora_id))
        first = seq.num_registered_pages
        self.allocator.register_full_pages(seq.pages[first:num_full], seq.page_hashes[first:num_full])
        seq.num_registered_pages = num_full

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=Sequence.queue_key)

    # ---- results --------------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, tokens: Seq[SampledToken | tuple[SampledToken, ...] | None]
               ) -> list[SequenceUpdate]:
        """Takes a step's results (one per plan row: a token, or for a verify row its accepted proposals and the
        target's next token, or a burst row's tokens; None for rows that did not sample) and applies them."""
        updates = []
        for row, result in zip(plan.seqs, tokens):
            if not row.sample:
                continue
            results = result if isinstance(result, tuple) else (result,)
            if row.draft_token_ids:
                self.speculation.add(row.num_draft_tokens, len(results) - 1)
            seq = self.sequences.get(row.seq_id)
            if seq is None or seq.is_finished:
                continue  # finished or aborted after this step was dispatched: the extra tokens are dropped
            seq.num_pending_tokens -= row.burst
            added, reason = self._append(seq, results)
            if row.draft_token_ids:
                self._settle_speculation(seq, len(added) - 1)
            if reason is not None:
                self.finish(seq, *reason)
            elif seq.status is SequenceStatus.RUNNING:
                self._register_full_pages(seq)
            updates.append(SequenceUpdate(seq.request_id, seq.index, added, seq.finish_reason, seq.stop_reason))
        return updates

    def _append(self, seq: Sequence, results: tuple[SampledToken, ...]
                ) -> tuple[tuple[SampledToken, ...], tuple[str, int | None] | None]:
        """Appends tokens up to the first that ends the sequence; returns those and the reason it ended."""
        for i, token in enumerate(results):
            seq.token_ids.append(token.token_id)
            reason = self._stop_reason(seq, token.token_id)
            if reason is not None:
                return results[:i + 1], reason
        return results, None

    def _settle_speculation(self, seq: Sequence, num_accepted: int) -> None:
        """A verify step is back: the K/V of the accepted proposals count as computed, pages past what the
        sequence's next token needs go back (they hold only rejected proposals)."""
        seq.num_speculated = 0
        if seq.status is not SequenceStatus.RUNNING:
            return  # preempted meanwhile: it recomputes everything
        seq.num_computed_tokens += num_accepted
        needed = -(-(seq.num_computed_tokens + 1) // self.config.page_size)
        if len(seq.pages) > needed:
            self.allocator.free(seq.pages[needed:])
            del seq.pages[needed:]

    def _stop_reason(self, seq: Sequence, token_id: int) -> tuple[str, int | None] | None:
        """EOS and stop tokens end a sequence only after min_tokens outputs (the sampler masks them before)."""
        params = seq.params
        if seq.num_output_tokens > params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return ("stop", None)
            if token_id in params.stop_token_ids:
                return ("stop", token_id)
        if len(seq.token_ids) >= seq.max_len:
            return ("length", None)
        return None

    def check_invariants(self) -> None:
        """Allocator invariant plus: every page is owned as often as its refcount says; slots are unique."""
        self.allocator.check_invariants()
        owners: dict[int, int] = {}
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING and seq.slot > 0
            assert len(seq.pages) * self.config.page_size >= seq.num_computed_tokens
            for page in seq.pages:
                owners[page] = owners.get(page, 0) + 1
        for seq in self.waiting + [s for v in self._held_forks.values() for s in v]:
            assert seq.slot == 0
            for page in seq.pages:
                owners[page] = owners.get(page, 0) + 1
        for page, count in owners.items():
            assert self.allocator.refcount(page) == count, f"page {page}: {count} owners, refcount differs"
        assert self.allocator.num_used_pages == len(owners)
        for seq in self.running:  # a sequence that may propose has the draft's K/V of every computed token
            computed = seq.pages[:-(-seq.num_computed_tokens // self.config.page_size)]
            assert seq.draft_stale or self._pages_without_draft.isdisjoint(computed), seq.seq_id
        slots = [s.slot for s in self.running]
        assert len(set(slots)) == len(slots) and not set(slots) & set(self._free_slots)
        assert len(slots) + len(self._free_slots) == self.config.num_slots - 1
        if self.adapter_slots is not None:
            self.adapter_slots.check_invariants()
            for adapter_id in self.adapter_slots.loaded:
                users = [s for s in self.running if s.lora_id == adapter_id]
                assert self.adapter_slots.refcount(adapter_id) == len(users), f"adapter {adapter_id} refcount"
                assert all(s.lora_slot == self.adapter_slots.slot_of(adapter_id) for s in users)


class _Budget:
    def __init__(self, tokens: int, seqs: int):
        self.tokens, self.seqs = tokens, seqs

    def has_room(self) -> bool:
        return self.tokens > 0 and self.seqs > 0

    def spend(self, tokens: int) -> None:
        self.tokens -= tokens
        self.seqs -= 1
