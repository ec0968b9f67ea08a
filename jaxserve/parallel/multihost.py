"""Multi-host: the same command on every host, joined by `jax.distributed`; process 0 leads.

    process 0 (leader)     HTTP, tokenizer, scheduler; publishes each step's inputs, then runs the step
    process k (follower)   reads each step's inputs in order and runs the same executables: the collectives
                           inside them (tensor parallelism across hosts) need every process to launch them

Step messages travel through the key-value store of JAX's coordination service (the one
`jax.distributed.initialize` starts on the coordinator), not through device collectives. Why:

  - it is host-to-host: the leader publishes without waiting for its devices. A device broadcast
    (`multihost_utils.broadcast_one_to_all`) is a program of its own queued behind the running step; reading its
    result would block the leader until step N finished before it could dispatch step N+1, losing the one-step-ahead
    overlap, and it needs fixed shapes (two broadcasts per step: a header, then the payload);
  - messages are bytes of any length (a plan's size varies step to step);
  - it is JAX's own distributed runtime, started by `jax.distributed.initialize`: no extra port, no home-made
    transport, and it fails every process when one dies (the coordination service's heartbeats).

    key  jaxserve/step/<n>   message n (bytes); followers read 0, 1, 2, ... in order (a blocking get, no polling)
    key  jaxserve/read/<n>   followers that have read message n; the last one deletes both keys
"""

from __future__ import annotations

import jax
import numpy as np

STEP_KEY = "jaxserve/step/{}"
READ_KEY = "jaxserve/read/{}"
WAIT_MS = 60_000  # a follower's blocking read gives up after this and simply waits again (an idle server)


def initialize(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """`jax.distributed.initialize` when a coordinator is given (once per process; before any other JAX call).
    Returns whether this is a multi-process run."""
    if coordinator_address is None:
        if num_processes not in (None, 1):
            raise ValueError("--num-processes > 1 needs --coordinator-address HOST:PORT (process 0's address)")
        return False
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (e.g. free device memory, so every host sizes the KV cache alike).
    A collective: every process calls it at the same point."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils
    return int(np.min(multihost_utils.process_allgather(np.int64(value))))


def _coordination_client():
    """The client `jax.distributed.initialize` connected to the coordination service. JAX has no public accessor;
    Orbax and jax.experimental reach it the same way."""
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multi-host stepping needs jax.distributed.initialize first (--coordinator-address)")
    return client


class StepChannel:
    """Ordered messages from the leader to every follower, one per step."""

    def __init__(self, num_followers: int | None = None, client=None):
        self.num_followers = jax.process_count() - 1 if num_followers is None else num_followers
        self._client = client or _coordination_client()
        self._next = 0

    def publish(self, payload: bytes) -> None:
        """Leader: message n (never blocks on the followers)."""
        self._client.key_value_set_bytes(STEP_KEY.format(self._next), payload)
        self._next += 1

    def receive(self) -> bytes:
        """Follower: the next message, waiting as long as the leader is idle."""
        key = STEP_KEY.format(self._next)
        while True:
            try:
                payload = self._client.blocking_key_value_get_bytes(key, WAIT_MS)
                break
            except Exception as exc:  # noqa: BLE001 - the runtime raises one error type for every status
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise
        if self._client.key_value_increment(READ_KEY.format(self._next), 1) == self.num_followers:
            self._client.key_value_delete(key)
            self._client.key_value_delete(READ_KEY.format(self._next))
        self._next += 1
        return payload
