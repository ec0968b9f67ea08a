"""Multi-host stepping: process 0's engine schedules, every process runs the same executables in the same order.

    leader (process 0)                           follower (process k)
    assign_slot(...)  -> mirror.assign (buffer)
    run(shape, inputs) -> mirror.step: publish ----> receive: assign_slot(...) for each buffered row
                         then execute locally         run(shape, inputs): the same executables
    close()            -> mirror.stop: publish ----> receive: stop, return

A message is an .npz archive of plain numpy arrays (no pickle): the step shape, the padded StepInputs, the
prompt-logprobs switch, and the slot rows assigned since the previous step. The two arrays that grow with the
configuration, the block tables ([S, P] int32: 512 KiB at S=256, P=512) and the new slots' token rows
([max_model_len + 1] int32 each), travel cropped to their nonzero corner and are zero-padded back on arrival
(lossless: their padding is zeros). Transport: jaxserve.parallel.multihost.
"""

from __future__ import annotations

import dataclasses
import io
import logging

import jax
import numpy as np

from jaxserve.engine.buckets import StepShape
from jaxserve.engine.runner import ModelRunner, StepInputs
from jaxserve.parallel.multihost import StepChannel, is_leader

log = logging.getLogger(__name__)
CROPPED = ("in.block_tables", "row.tokens")  # zero-padded 2-D arrays that can be large


@dataclasses.dataclass
class StepMessage:
    assigns: list[tuple[int, dict]]  # (slot, row) in the order the leader assigned them
    shape: StepShape | None  # None: stop
    inputs: StepInputs | None = None
    prompt_logprobs: bool = False


def encode(message: StepMessage) -> bytes:
    arrays: dict[str, np.ndarray] = {"slots": np.array([slot for slot, _ in message.assigns], np.int32)}
    for name in (message.assigns[0][1] if message.assigns else {}):
        arrays[f"row.{name}"] = np.stack([np.asarray(row[name]) for _, row in message.assigns])
    if message.shape is not None:
        s = message.shape
        arrays["shape"] = np.array([s.kind, str(s.tokens), str(s.seqs), str(s.pages)])
        arrays["prompt_logprobs"] = np.array(message.prompt_logprobs)
        arrays.update({f"in.{f.name}": np.asarray(getattr(message.inputs, f.name))
                       for f in dataclasses.fields(StepInputs) if getattr(message.inputs, f.name) is not None})
    for key in CROPPED:
        if key in arrays:
            arrays[f"{key}.shape"] = np.array(arrays[key].shape)
            arrays[key] = _crop(arrays[key])
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def decode(payload: bytes) -> StepMessage:
    with np.load(io.BytesIO(payload), allow_pickle=False) as archive:
        z = {key: archive[key] for key in archive.files}
    for key in CROPPED:
        if key in z:
            z[key] = _pad(z[key], tuple(z.pop(f"{key}.shape")))
    rows = {key.removeprefix("row."): z[key] for key in z if key.startswith("row.")}
    assigns = [(int(slot), {name: values[i] for name, values in rows.items()}) for i, slot in enumerate(z["slots"])]
    if "shape" not in z:
        return StepMessage(assigns, None)
    kind, tokens, seqs, pages = z["shape"].tolist()
    inputs = StepInputs(**{f.name: z[f"in.{f.name}"] for f in dataclasses.fields(StepInputs) if f"in.{f.name}" in z})
    return StepMessage(assigns, StepShape(kind, int(tokens), int(seqs), int(pages)), inputs,
                       bool(z["prompt_logprobs"]))


def _crop(table: np.ndarray) -> np.ndarray:
    """The smallest top-left corner of a 2-D array holding every nonzero entry."""
    rows, cols = np.nonzero(table)
    return table[:rows.max(initial=-1) + 1, :cols.max(initial=-1) + 1]


def _pad(table: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    out = np.zeros(shape, table.dtype)
    out[:table.shape[0], :table.shape[1]] = table
    return out


class StepMirror:
    """The leader's side: the runner reports each device call here before making it."""

    def __init__(self, channel: StepChannel):
        self.channel = channel
        self._assigns: list[tuple[int, dict]] = []

    def assign(self, slot: int, row: dict) -> None:
        self._assigns.append((slot, row))

    def step(self, shape: StepShape, inputs: StepInputs, prompt_logprobs: bool) -> None:
        self.channel.publish(encode(StepMessage(self._assigns, shape, inputs, prompt_logprobs)))
        self._assigns = []

    def stop(self) -> None:
        self.channel.publish(encode(StepMessage(self._assigns, None)))
        self._assigns = []


def leader_mirror() -> StepMirror | None:
    """What process 0's runner reports to in a multi-process run; None otherwise."""
    if jax.process_count() == 1 or not is_leader():
        return None
    return StepMirror(StepChannel())


def follow_if_follower(engine) -> int | None:
    """On a multi-host follower: runs the leader's steps on `engine` (an LLMEngine) until the leader stops, then
    returns how many it ran. Returns None at once on the leader or in a single-process run."""
    if jax.process_count() == 1 or is_leader():
        return None
    return follow(engine.runner)


def follow(runner: ModelRunner, channel: StepChannel | None = None) -> int:
    """A follower's life: run every step the leader publishes, until it stops. Returns the number of steps."""
    channel = channel or StepChannel()
    steps = 0
    while True:
        message = decode(channel.receive())
        for slot, row in message.assigns:
            runner.assign_slot(slot, row)
        if message.shape is None:
            log.info("the leader stopped after %d steps", steps)
            return steps
        runner.run(message.shape, message.inputs, message.prompt_logprobs)
        steps += 1
