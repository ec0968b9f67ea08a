"""Host-side state of one sample stream. No jax.

A request with `n` samples becomes n Sequences. What a Sequence knows about its tokens:

    token_ids          | prompt .............. | outputs known on host |  + num_pending_tokens (sampled by
                       0                num_prompt_tokens        len(token_ids)      dispatched steps, not back yet)
    num_computed_tokens: positions whose K/V are in the cache, or will be once the dispatched steps finish.

The scheduler may run one step ahead of the host: a decode step's input token can be the pending one, which the
device reads from its own token buffer.
"""

from __future__ import annotations

import dataclasses
import enum

from jaxserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (no pages, no slot)
    RUNNING = "running"  # holds pages and a device slot
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # sample index within its request
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    max_len: int  # total tokens (prompt + output) at which the sequence stops with "length"
    seed: int
    arrival_time: float
    priority: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    num_speculated: int = 0  # proposals of the verify step in flight (how many it accepts is not back yet)
    pages: list[int] = dataclasses.field(default_factory=list)
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of full pages of token_ids
    num_registered_pages: int = 0  # pages[:k] are in the prefix cache index
    slot: int = 0  # device slot while RUNNING; 0 (the null slot) otherwise
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    fork_parent: "Sequence | None" = None  # a sibling waiting to share this sequence's prompt pages
    lora_id: int = 0  # the LoRA adapter it runs with (jaxserve.lora.registry id; 0 = none)
    lora_slot: int = 0  # that adapter's device slot while RUNNING; 0 otherwise
    draft_stale: bool = False  # the draft model's cache misses some of its tokens: it proposes no more

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence has, including sampled ones still on their way back."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.index == 0

    def queue_key(self) -> tuple[int, float, int]:
        """Order in the waiting queue and preemption priority: lower runs first and is preempted last."""
        return (self.priority, self.arrival_time, self.seq_id)
