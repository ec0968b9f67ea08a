"""Reliability at the engine client boundary (AsyncEngine over the tiny llama3.1 fixture): no request can kill the
engine; a failure in one request's step preparation, in one step, or in one request's output fails only the
requests it concerns; a device failure is fatal (the engine is rebuilt in place while restarts are left, then the
fatal listeners are told); a hung step trips the watchdog; admission is exact; a stalled reader costs nothing."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import jax
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from jaxserve.engine import engine as engine_module
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.client import EngineDeadError, EngineHungError, QueueFullError
from jaxserve.engine.engine import EngineCore
from jaxserve.engine.output import RequestState
from jaxserve.engine.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import InvalidRequestError
from test_server_harness import TINY_ENGINE

SHORT = SamplingParams(temperature=0.0, max_tokens=4)
LONG = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
LONGEST = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)  # nearly max_model_len (256)
PARAMS = frozenset(SamplingParams.__dataclass_fields__) | {"prompt"}


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("llama3.1")


@pytest.fixture(scope="module")
def core(model_dir):
    """One engine core the tests that leave it healthy share (each drives it with its own AsyncEngine)."""
    return EngineCore.from_model_dir(model_dir, TINY_ENGINE, show_progress=False)


@contextlib.contextmanager
def started(core, check: bool = True, **options):
    """An AsyncEngine over `core`; afterwards (`check`) the core is idle, consistent, and holds no page."""
    engine = AsyncEngine(core, **options).start()
    try:
        yield engine
    finally:
        engine.stop()
    if check:
        assert not core.has_unfinished_requests()
        core.scheduler.check_invariants()
        assert core.scheduler.allocator.usage == 0.0  # every page came back


async def run(engine, request_id: str, params: SamplingParams = SHORT, prompt="The river ran"):
    """Every output of one request, the last finished."""
    stream = await engine.add_request(request_id, prompt, params)
    outputs = [output async for output in stream]
    assert outputs[-1].finished
    return outputs


def wait_until(condition, timeout: float = 30.0) -> None:
    """Polls `condition` until it holds or `timeout` seconds pass (the caller asserts what it needs after)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def tokens_of(outputs) -> list[int]:
    return [t for output in outputs for t in output.outputs[0].token_ids]


def serves_normally(engine) -> bool:
    outputs = asyncio.run(run(engine, f"check-{time.monotonic_ns()}"))
    return engine.is_alive and outputs[-1].error is None and len(tokens_of(outputs)) == 4


# ---- requests that used to kill the engine ------------------------------------------------------------------
def test_the_engine_killing_requests_are_refused_and_the_engine_serves_on(core):
    with started(core) as engine:
        async def refused(params: SamplingParams) -> InvalidRequestError:
            with pytest.raises(InvalidRequestError) as error:
                await engine.add_request("killer", "The river ran", params)
            return error.value

        top_k = asyncio.run(refused(SamplingParams(temperature=1.0, top_k=2**31)))
        assert top_k.param == "top_k" and "2147483648" in str(top_k)
        min_tokens = asyncio.run(refused(SamplingParams(min_tokens=2**31, max_tokens=None)))
        assert min_tokens.param == "min_tokens"
        assert serves_normally(engine)


# ---- one request fails alone ----------------------------------------------------------------------------------
def test_a_request_whose_step_preparation_raises_fails_alone(core, monkeypatch):
    real_slot_row = engine_module.slot_row

    def slot_row(token_ids, num_prompt_tokens, params, *args):
        if params.seed == 13:
            raise OverflowError("injected: this request's row cannot be built")
        return real_slot_row(token_ids, num_prompt_tokens, params, *args)

    monkeypatch.setattr(engine_module, "slot_row", slot_row)
    with started(core) as engine:
        async def scenario():
            good = asyncio.ensure_future(run(engine, "good", LONG))
            await asyncio.sleep(0)
            bad = await run(engine, "bad", SamplingParams(seed=13, max_tokens=8))
            return bad, await good

        bad, good = asyncio.run(scenario())
        assert bad[-1].error is not None and "injected" in bad[-1].error
        assert bad[-1].outputs[0].finish_reason == "error"
        assert good[-1].error is None and len(tokens_of(good)) == 96
        assert serves_normally(engine)


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(core, monkeypatch):
    real_dispatch = ModelRunner.dispatch
    calls = [0]

    def dispatch(self, plan, flags):
        calls[0] += 1
        if calls[0] == 6:  # both requests are decoding by then
            raise RuntimeError("injected host failure in a step")
        return real_dispatch(self, plan, flags)

    monkeypatch.setattr(ModelRunner, "dispatch", dispatch)
    with started(core) as engine:
        async def scenario():
            return await asyncio.gather(run(engine, "a", LONG), run(engine, "b", LONG))

        for outputs in asyncio.run(scenario()):
            assert "injected host failure" in outputs[-1].error
        assert engine.is_alive and engine.error is None
        assert serves_normally(engine)


def test_a_request_whose_output_cannot_be_processed_fails_alone(core, monkeypatch):
    real_add_tokens = RequestState._add_tokens

    def add_tokens(self, sample, delta, now):
        if self.request_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_add_tokens(self, sample, delta, now)

    monkeypatch.setattr(RequestState, "_add_tokens", add_tokens)
    with started(core) as engine:
        async def scenario():
            return await asyncio.gather(run(engine, "bad", LONG), run(engine, "good", LONG))

        bad, good = asyncio.run(scenario())
        assert "injected" in bad[-1].error
        assert good[-1].error is None and len(tokens_of(good)) == 96
        assert serves_normally(engine)  # and `started` checks that the bad request's pages came back


# ---- the whole parameter space at the boundary ----------------------------------------------------------------
EXTREME_INTS = st.sampled_from([-1, 0, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -2**31 - 1, -2**63])
NUMBERS = st.one_of(st.integers(-2, 40), EXTREME_INTS, st.floats(allow_nan=True, allow_infinity=True),
                    st.booleans(), st.none())
SMALL_COUNTS = st.one_of(st.integers(1, 2), st.sampled_from([0, -1, 129, 2**31, 1.5, None, True]))
TEXT = st.one_of(st.text(max_size=12), st.text(max_size=4).map(lambda t: t + "\ud800"))
PROMPTS = st.one_of(TEXT.filter(bool), st.lists(st.one_of(st.integers(0, 300), EXTREME_INTS), max_size=8),
                    st.just([1] * 300))
FIELDS = {
    "n": SMALL_COUNTS,
    "max_tokens": st.one_of(st.integers(1, 6), st.sampled_from([0, -1, 300, 2**31, 2**63, 2.5, None])),
    "min_tokens": st.one_of(st.integers(0, 4), EXTREME_INTS, st.sampled_from([250, 1.5])),
    "temperature": NUMBERS, "top_p": NUMBERS, "top_k": NUMBERS, "min_p": NUMBERS,
    "repetition_penalty": NUMBERS, "presence_penalty": NUMBERS, "frequency_penalty": NUMBERS,
    "seed": NUMBERS, "logprobs": NUMBERS, "prompt_logprobs": NUMBERS,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=20), st.just(["x" * 600])),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, 600), EXTREME_INTS), max_size=20),
    "ignore_eos": st.one_of(st.booleans(), st.none(), st.just(1)),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.one_of(st.booleans(), st.just("no")),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-1, 600), EXTREME_INTS), NUMBERS.filter(
        lambda v: not isinstance(v, bool) and v is not None), max_size=4),
}
PARAM_VALUES = st.fixed_dictionaries({}, optional=FIELDS)


def test_any_request_is_accepted_and_completes_or_refused_naming_its_parameter(core):
    """Hypothesis over the whole parameter space: extreme ints, NaN, infinities, None, bools, lone surrogates,
    long lists. No outcome but a completed request or an InvalidRequestError naming a field; the engine lives."""
    outcomes: dict[str, int] = {"completed": 0, "refused": 0}
    with started(core) as engine:
        @settings(max_examples=150, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(prompt=PROMPTS, values=PARAM_VALUES)
        @example(prompt="The river ran", values={"temperature": 1.0, "top_k": 2**31})  # the two that killed it
        @example(prompt="The river ran", values={"min_tokens": 2**31, "max_tokens": None})
        def any_request(prompt, values):
            try:
                params = SamplingParams(**values)
            except (TypeError, ValueError, OverflowError):
                return  # the caller could not even build it: nothing reached the engine
            try:
                outputs = asyncio.run(asyncio.wait_for(run(engine, "any", params, prompt), 120))
            except InvalidRequestError as error:
                assert error.param in PARAMS, error
                outcomes["refused"] += 1
            else:
                assert outputs[-1].error is None, outputs[-1].error
                outcomes["completed"] += 1
            assert engine.is_alive

        any_request()
        assert outcomes["completed"] > 5 and outcomes["refused"] > 5, outcomes
        assert serves_normally(engine)


# ---- exact admission ------------------------------------------------------------------------------------------
def test_max_queued_requests_never_lets_more_wait(core):
    """4 long requests fill the 4 slots; a burst of 12 then finds room for exactly 2 in the queue. Polled every
    10 ms, nothing ever waits beyond the limit."""
    limit = 2
    seen: list[int] = []
    stop = threading.Event()

    def poll():
        while not stop.wait(0.01):
            seen.append(core.scheduler.num_waiting)

    with started(core, max_queued_requests=limit) as engine:
        async def scenario():
            running = []
            for i in range(4):
                while engine.num_queued >= limit:
                    await asyncio.sleep(0.01)
                running.append(asyncio.ensure_future(run(engine, f"long-{i}", LONGEST)))
                await asyncio.sleep(0)
            while core.scheduler.num_waiting or engine.num_queued:
                await asyncio.sleep(0.01)
            burst = await asyncio.gather(*(run(engine, f"burst-{i}", SHORT) for i in range(12)),
                                         return_exceptions=True)
            await asyncio.gather(*running)
            return burst

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            burst = asyncio.run(scenario())
        finally:
            stop.set()
            poller.join()
    refused = [b for b in burst if isinstance(b, QueueFullError)]
    assert len(refused) == 10 and "2 requests are already waiting" in str(refused[0])
    assert max(seen) <= limit and len(seen) > 3


# ---- a stalled reader -----------------------------------------------------------------------------------------
def test_a_stalled_reader_gets_one_output_with_everything_it_missed(core):
    with started(core) as engine:
        async def scenario():
            stream = await engine.add_request("stalled", "The river ran", LONG)
            while core.has_unfinished_requests():  # the reader looks away for the whole generation
                await asyncio.sleep(0.05)
            return [output async for output in stream]

        outputs = asyncio.run(scenario())
    assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 96


# ---- a dead or stuck engine -----------------------------------------------------------------------------------
def test_a_device_failure_rebuilds_the_engine_then_gives_up_when_no_restart_is_left(model_dir, monkeypatch):
    failing = threading.Event()
    real_dispatch = ModelRunner.dispatch

    def dispatch(self, plan, flags):
        if failing.is_set():
            failing.clear()
            raise jax.errors.JaxRuntimeError("INTERNAL: injected device failure")
        return real_dispatch(self, plan, flags)

    monkeypatch.setattr(ModelRunner, "dispatch", dispatch)
    rebuilt, stopped = [], []

    def rebuild():
        rebuilt.append(EngineCore.from_model_dir(model_dir, TINY_ENGINE, show_progress=False))
        return rebuilt[-1]

    first = EngineCore.from_model_dir(model_dir, TINY_ENGINE, show_progress=False)
    with started(first, check=False, rebuild=rebuild, max_restarts=1) as engine:
        engine.add_fatal_listener(stopped.append)

        async def fail_one():
            stream = await engine.add_request("victim", "The river ran", LONG)
            failing.set()
            return [output async for output in stream]

        victim = asyncio.run(fail_one())
        assert "injected device failure" in victim[-1].error
        wait_until(lambda: rebuilt and engine.is_alive, 300)
        assert engine.is_alive and engine.restarts_left == 0 and not stopped
        assert serves_normally(engine)
        victim = asyncio.run(fail_one())  # no restart left: the engine stops for good
        assert "injected device failure" in victim[-1].error
        wait_until(lambda: stopped)
        assert len(stopped) == 1 and isinstance(stopped[0], jax.errors.JaxRuntimeError)
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            asyncio.run(run(engine, "late"))


def test_a_hung_step_trips_the_watchdog(model_dir, monkeypatch):
    hang, release = threading.Event(), threading.Event()
    real_dispatch = ModelRunner.dispatch

    def dispatch(self, plan, flags):
        if hang.is_set():
            release.wait(60)
        return real_dispatch(self, plan, flags)

    monkeypatch.setattr(ModelRunner, "dispatch", dispatch)
    core = EngineCore.from_model_dir(model_dir, TINY_ENGINE, show_progress=False)
    stopped = []
    try:
        with started(core, check=False, step_timeout=1.0) as engine:
            engine.add_fatal_listener(stopped.append)

            async def stuck():
                stream = await engine.add_request("stuck", "The river ran", LONG)
                hang.set()
                started_at = time.monotonic()
                outputs = [output async for output in stream]
                return outputs, time.monotonic() - started_at

            outputs, waited = asyncio.run(stuck())
            assert "no engine step finished in 1 s" in outputs[-1].error and waited < 10
            wait_until(lambda: stopped)  # the watchdog fails the requests first, then tells the listeners
            assert len(stopped) == 1 and isinstance(stopped[0], EngineHungError)
            assert not engine.is_alive and isinstance(engine.error, EngineHungError)
            with pytest.raises(EngineDeadError):
                asyncio.run(run(engine, "late"))
    finally:
        release.set()
