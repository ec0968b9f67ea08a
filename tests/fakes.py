"""A fake device for scheduler tests: it keeps a token buffer per slot and a paged "KV cache" of token ids, the
way the real engine keeps its device state, and checks on every step that each sequence's pages hold exactly its
tokens. Its "model" is a hash of the sequence's tokens, so outputs can be computed by hand."""

from __future__ import annotations

from jaxserve.scheduler.scheduler import SampledToken, Scheduler, StepPlan


def next_token(tokens: list[int], vocab: int = 97) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % vocab


def reference_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeDevice:
    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        self.page_size = page_size
        self.kv = [[None] * page_size for _ in range(num_pages)]
        self.buffers: list[list[int]] = [[] for _ in range(num_slots)]

    def execute(self, plan: StepPlan) -> list[SampledToken | None]:
        for assignment in plan.new_slots:
            self.buffers[assignment.slot] = list(assignment.token_ids)
        results = []
        for row in plan.seqs:
            buffer = self.buffers[row.slot]
            if row.burst > 1:
                results.append(self._burst(row, buffer))
                continue
            known = row.context_len - row.num_draft_tokens  # a verify row's proposals come after its tokens
            assert len(buffer) >= known, "a token the step needs was never sampled"
            if row.draft_token_ids:
                del buffer[known:]
                buffer.extend(row.draft_token_ids)
            for pos in range(row.context_len - row.num_new_tokens, row.context_len):
                self.kv[row.pages[pos // self.page_size]][pos % self.page_size] = buffer[pos]
            cached = [self.kv[row.pages[p // self.page_size]][p % self.page_size] for p in range(row.context_len)]
            assert cached == buffer[:row.context_len], "the cache pages do not hold the sequence's tokens"
            if row.sample:
                tokens = self._accept(buffer, known, row.draft_token_ids)
                results.append(tuple(SampledToken(t) for t in tokens) if row.draft_token_ids else
                               SampledToken(tokens[0]))
            else:
                results.append(None)
        return results

    def _burst(self, row, buffer: list[int]) -> tuple[SampledToken, ...]:
        """A decode burst: row.burst decode steps, each one's input the token the one before sampled."""
        first = row.context_len - row.burst + 1  # the context of its first step
        assert len(buffer) >= first and row.sample and row.num_new_tokens == row.burst
        del buffer[first:]
        for pos in range(first - 1, row.context_len):
            self.kv[row.pages[pos // self.page_size]][pos % self.page_size] = buffer[pos]
            buffer.append(next_token(buffer))
        cached = [self.kv[row.pages[p // self.page_size]][p % self.page_size] for p in range(row.context_len)]
        assert cached == buffer[:row.context_len], "the cache pages do not hold the sequence's tokens"
        return tuple(SampledToken(t) for t in buffer[first:])

    @staticmethod
    def _accept(buffer: list[int], known: int, drafts: tuple[int, ...]) -> list[int]:
        """Greedy verification: proposals while they equal the model's next token, then the model's token."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == next_token(buffer[:known + accepted]):
            accepted += 1
        del buffer[known + accepted:]
        buffer.append(next_token(buffer))
        return buffer[known:]


def run_to_completion(scheduler: Scheduler, device: FakeDevice, lag: int = 0, on_step=None, max_steps=10_000):
    """Drives the scheduler like the engine does; with lag=1 the next plan is made before the last result is in."""
    in_flight: list[tuple[StepPlan, list]] = []
    steps = 0
    while scheduler.has_work or in_flight:
        plan = scheduler.schedule()
        if not plan.is_empty:
            in_flight.append((plan, device.execute(plan)))
        while in_flight and (len(in_flight) > lag or plan.is_empty):
            done, tokens = in_flight.pop(0)
            scheduler.update(done, tokens)
        if on_step is not None:
            on_step(plan)
        scheduler.check_invariants()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps
