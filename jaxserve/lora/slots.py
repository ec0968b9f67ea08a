"""Which adapter occupies which device slot. Host-side bookkeeping only: no jax.

    slot 0         no adapter (the device arrays hold zeros there); never handed out
    slot 1..N      empty | an adapter with a refcount (running sequences that use it)
                   refcount 0: still loaded and reusable, evicted least recently used first

    empty + in use + idle == N                                        (check_invariants)

acquire() gives a sequence its adapter's slot, loading it (into an empty slot, else over the least recently used
idle one) when it is not there; the load is recorded for the engine, which writes the weights before it dispatches
the step that first uses them. A sequence whose adapter finds no slot waits (can_acquire is False) until another
adapter's last sequence releases its slot.
"""

from __future__ import annotations

import collections


class AdapterSlots:
    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, not {max_loras}")
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}  # adapter id -> slot
        self._refcount: dict[int, int] = {}  # adapter id -> sequences holding it (loaded adapters only)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # refcount 0, LRU first
        self._empty = list(range(max_loras, 0, -1))  # pop() hands out slot 1 first
        self._loads: list[tuple[int, int]] = []  # (slot, adapter id) written since take_loads

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot_of.get(adapter_id)

    def refcount(self, adapter_id: int) -> int:
        return self._refcount.get(adapter_id, 0)

    @property
    def loaded(self) -> tuple[int, ...]:
        return tuple(self._slot_of)

    def can_acquire(self, adapter_id: int) -> bool:
        return adapter_id in self._slot_of or bool(self._empty or self._idle)

    def acquire(self, adapter_id: int) -> int:
        """The adapter's slot, with one more reference; loads it first if needed (check can_acquire)."""
        if adapter_id not in self._slot_of:
            self._load(adapter_id)
        self._idle.pop(adapter_id, None)
        self._refcount[adapter_id] += 1
        return self._slot_of[adapter_id]

    def release(self, adapter_id: int) -> None:
        if self._refcount.get(adapter_id, 0) <= 0:
            raise ValueError(f"adapter {adapter_id} released more often than acquired")
        self._refcount[adapter_id] -= 1
        if self._refcount[adapter_id] == 0:
            self._idle[adapter_id] = None

    def forget(self, adapter_id: int) -> None:
        """An unloaded adapter gives its slot back (it must have no references)."""
        if self._refcount.get(adapter_id, 0):
            raise ValueError(f"adapter {adapter_id} is still in use by {self._refcount[adapter_id]} sequences")
        slot = self._slot_of.pop(adapter_id, None)
        if slot is not None:
            del self._refcount[adapter_id]
            self._idle.pop(adapter_id, None)
            self._empty.append(slot)

    def take_loads(self) -> tuple[tuple[int, int], ...]:
        """The (slot, adapter id) writes the device owes since the last call."""
        loads, self._loads = tuple(self._loads), []
        return loads

    def _load(self, adapter_id: int) -> None:
        if self._empty:
            slot = self._empty.pop()
        elif self._idle:
            evicted, _ = self._idle.popitem(last=False)
            slot = self._slot_of.pop(evicted)
            del self._refcount[evicted]
        else:
            raise RuntimeError(f"no free LoRA slot for adapter {adapter_id}; check can_acquire first")
        self._slot_of[adapter_id] = slot
        self._refcount[adapter_id] = 0
        self._loads = [(s, a) for s, a in self._loads if s != slot] + [(slot, adapter_id)]

    def check_invariants(self) -> None:
        slots = list(self._slot_of.values())
        assert len(set(slots)) == len(slots), "two adapters in one slot"
        assert not set(slots) & set(self._empty), "a slot is both empty and loaded"
        assert sorted(slots + self._empty) == list(range(1, self.max_loras + 1)), "slots lost or invented"
        assert set(self._idle) == {a for a, n in self._refcount.items() if n == 0}, "idle list out of sync"
        assert set(self._refcount) == set(self._slot_of), "refcounts out of sync"
