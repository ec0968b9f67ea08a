"""The engine boundary without a model: the frozen types that cross it, the output processor's kinds, stop strings
with hold-back, and the layering that keeps the server on the client protocol."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import typing

import pytest

from jaxserve.engine import messages
from jaxserve.engine.messages import PromptLogprobsChunk, SampleDelta, SchedulerStats, StepOutputs
from jaxserve.engine.output import OutputProcessor, StopFinish
from jaxserve.outputs import OutputKind, TokenLogprob
from jaxserve.sampling_params import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxserve"


class CharTokenizer:
    """Token id i is the character chr(i): decode joins them (enough for the incremental detokenizer)."""

    skipped_special_ids = frozenset()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def step(*deltas: SampleDelta, now: float = 1.0) -> StepOutputs:
    return StepOutputs(tuple(deltas), SchedulerStats(), (), now)


def token(request_id: str, char: str, index: int = 0, **fields) -> SampleDelta:
    return SampleDelta(request_id, index, (ord(char),), **fields)


def logprob(char: str) -> tuple[TokenLogprob, ...]:
    return (TokenLogprob(ord(char), -0.5, ((ord(char), -0.5),)),)


# ---- what crosses the boundary is immutable -----------------------------------------------------------------
IMMUTABLE_LEAVES = (int, float, str, bool, type(None))


def assert_deeply_immutable(value, path="value"):
    if isinstance(value, IMMUTABLE_LEAVES) or isinstance(value, SamplingParams):
        return  # SamplingParams: frozen, every field a tuple or a scalar (checked below)
    if isinstance(value, tuple):
        for i, item in enumerate(value):
            assert_deeply_immutable(item, f"{path}[{i}]")
        return
    assert dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen, f"{path} is mutable: {value!r}"
    for field in dataclasses.fields(value):
        assert_deeply_immutable(getattr(value, field.name), f"{path}.{field.name}")


def test_every_type_crossing_the_engine_boundary_is_frozen_all_the_way_down():
    """The engine thread's outputs (StepOutputs) and inputs (EngineRequest) hold only frozen dataclasses, tuples
    and scalars, so a value handed across can never change under the reader; a dataclass field typed as a list,
    dict or set would fail here."""
    for cls in (messages.EngineRequest, messages.PromptLogprobsChunk, messages.SampleDelta, messages.SchedulerStats,
                messages.StepOutputs, TokenLogprob, SamplingParams):
        assert cls.__dataclass_params__.frozen, cls
        for name, hint in typing.get_type_hints(cls).items():
            assert not any(t in str(hint) for t in ("list", "dict", "set[")), f"{cls.__name__}.{name}: {hint}"
    delta = SampleDelta("r", 0, (1, 2), logprob("a") * 2, "stop", 2,
                        PromptLogprobsChunk(1, (-1.0,), (((3, -1.0),),)), 0.5)
    assert_deeply_immutable(StepOutputs((delta,), SchedulerStats(num_running=1), ("r",), 2.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        delta.token_ids = ()  # type: ignore[misc]


def test_outputs_share_no_list_with_the_processor():
    processor = OutputProcessor(CharTokenizer())
    processor.add("a", None, (1,), SamplingParams(max_tokens=8, logprobs=0), 0.0, OutputKind.CUMULATIVE)
    [first], _ = processor.process(step(token("a", "x", logprobs=logprob("x"))))
    first.outputs[0].token_ids.append(99)
    first.outputs[0].logprobs.clear()
    [second], _ = processor.process(step(token("a", "y", logprobs=logprob("y"))))
    assert second.outputs[0].token_ids == [ord("x"), ord("y")] and len(second.outputs[0].logprobs) == 2


# ---- output kinds -------------------------------------------------------------------------------------------
def run(kind: OutputKind, params: SamplingParams, deltas_per_step):
    processor = OutputProcessor(CharTokenizer())
    processor.add("a", "prompt", (1, 2, 3), params, 0.0, kind)
    outputs = []
    for t, deltas in enumerate(deltas_per_step):
        produced, _ = processor.process(step(*deltas, now=float(t + 1)))
        outputs.extend(produced)
    return outputs, processor


def test_delta_outputs_hold_only_what_is_new_and_the_last_lists_every_sample():
    params = SamplingParams(n=2, max_tokens=3, logprobs=0)
    steps = [[token("a", "h", 0, logprobs=logprob("h")), token("a", "o", 1, logprobs=logprob("o"))],
             [token("a", "i", 0, logprobs=logprob("i"), finish_reason="length")],
             [token("a", "k", 1, logprobs=logprob("k"), finish_reason="stop", stop_reason=7)]]
    outputs, processor = run(OutputKind.DELTA, params, steps)
    assert [[(o.index, o.text, o.token_ids, o.num_tokens) for o in out.outputs] for out in outputs] == [
        [(0, "h", [ord("h")], 1), (1, "o", [ord("o")], 1)],
        [(0, "i", [ord("i")], 2)],
        [(0, "", [], 2), (1, "k", [ord("k")], 2)]]  # the final output tells how every sample ended
    assert [len(o.logprobs) for out in outputs for o in out.outputs] == [1, 1, 1, 0, 1]
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    assert outputs[-1].metrics.first_token_time == 1.0 and outputs[-1].metrics.inter_token_latencies == (1.0, 1.0)
    # each sample's own times, as vLLM's child requests have them (sample 1 got no token at t=2)
    first, second = outputs[-1].metrics.samples
    assert (first.first_token_time, first.last_token_time, first.inter_token_latencies) == (1.0, 2.0, (1.0,))
    assert (second.first_token_time, second.last_token_time, second.inter_token_latencies) == (1.0, 3.0, (2.0,))
    assert not processor.states  # a finished request is forgotten


def test_final_only_gives_one_output_with_everything():
    steps = [[token("a", c)] for c in "abc"] + [[token("a", "d", finish_reason="length")]]
    outputs, _ = run(OutputKind.FINAL_ONLY, SamplingParams(max_tokens=4), steps)
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].text == "abcd" and outputs[0].outputs[0].token_ids == [ord(c) for c in "abcd"]


def test_cumulative_outputs_hold_everything_so_far():
    steps = [[token("a", c)] for c in "ab"]
    outputs, _ = run(OutputKind.CUMULATIVE, SamplingParams(max_tokens=4), steps)
    assert [o.outputs[0].text for o in outputs] == ["a", "ab"]


# ---- stop strings -------------------------------------------------------------------------------------------
def test_a_stop_string_across_deltas_is_held_back_cut_and_reported_once():
    params = SamplingParams(max_tokens=20, stop=("END",))
    processor = OutputProcessor(CharTokenizer())
    processor.add("a", None, (1,), params, 0.0, OutputKind.DELTA)
    texts, finishes = [], []
    for char in "xyEN":
        outputs, stops = processor.process(step(token("a", char)))
        texts.extend(o.outputs[0].text for o in outputs)
        finishes.extend(stops)
    assert "".join(texts) == "xy"  # "EN" could begin the stop string: held back
    outputs, stops = processor.process(step(token("a", "D")))
    assert stops == [StopFinish("a", 0, "END")]
    assert outputs[0].finished and outputs[0].outputs[0].finish_reason == "stop"
    assert outputs[0].outputs[0].stop_reason == "END" and outputs[0].outputs[0].text == ""
    # a token the engine computed before it freed the sequence is dropped
    assert processor.process(step(token("a", "z"))) == ([], [])


def test_prompt_logprobs_arrive_in_chunks_and_are_sent_once_complete():
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    processor = OutputProcessor(CharTokenizer())
    processor.add("a", None, (10, 11, 12, 13), params, 0.0, OutputKind.DELTA)
    chunk = lambda first, n: PromptLogprobsChunk(first, (-1.0,) * n, (((5, -1.0),),) * n)  # noqa: E731
    assert processor.process(step(SampleDelta("a", 0, prompt_logprobs=chunk(1, 2)))) == ([], [])
    [output], _ = processor.process(step(token("a", "q", prompt_logprobs=chunk(3, 2))))  # 1 past the prompt
    assert output.prompt_logprobs[0] is None
    assert [e.token_id for e in output.prompt_logprobs[1:]] == [11, 12, 13]
    [last], _ = processor.process(step(token("a", "r", finish_reason="length")))
    assert last.prompt_logprobs is None  # sent once


def test_engine_failure_ends_every_sample_with_the_error():
    processor = OutputProcessor(CharTokenizer())
    processor.add("a", None, (1,), SamplingParams(n=2, max_tokens=4), 0.0, OutputKind.DELTA)
    processor.process(step(token("a", "x", 0)))
    [output] = processor.fail(["a", "unknown"], "RuntimeError: boom", 2.0)
    assert output.finished and output.error == "RuntimeError: boom"
    assert [o.finish_reason for o in output.outputs] == ["error", "error"]


# ---- layering -----------------------------------------------------------------------------------------------
def imported_modules(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_the_server_and_metrics_know_the_engine_only_through_its_client_protocol():
    """jaxserve/server (but `serve`'s command, which starts an engine for it) and the metrics import from
    jaxserve.engine only the client protocol and the boundary's frozen types; and those import no jax."""
    allowed = {"jaxserve.engine.client", "jaxserve.engine.messages"}
    for path in sorted((ROOT / "server").glob("*.py")):
        if path.name == "command.py":
            continue
        engine_imports = {m for m in imported_modules(path) if m.startswith("jaxserve.engine")}
        assert engine_imports <= allowed, f"{path.name} imports {engine_imports - allowed}"
    for module in allowed:
        path = ROOT.parent / (module.replace(".", "/") + ".py")
        assert not any(m.split(".")[0] in ("jax", "flax", "numpy") for m in imported_modules(path)), path
