"""Data-parallel serving: the HTTP server in front of a ReplicaRouter over two engine replicas (both on this
process's one CPU device; device placement of replicas is tests/test_parallel.py's job). Concurrent clients get the
offline engine's greedy text, both replicas do work, and the shared admission limit answers 429."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from jaxserve.engine.engine import EngineCore, LLMEngine
from jaxserve.engine.llm import LLM
from jaxserve.engine.replicas import ReplicaRouter
from jaxserve.parallel import single_device_mesh
from jaxserve.sampling_params import SamplingParams
from test_server_harness import TINY_ENGINE, serve_in_thread, server_state

PROMPTS = [f"Client {i} says" for i in range(8)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("llama3.1")


@pytest.fixture(scope="module")
def replicas(model_dir):
    return [EngineCore.from_model_dir(model_dir, TINY_ENGINE, show_progress=False, mesh=single_device_mesh())
            for _ in range(2)]


def completions(url: str, prompts: list[str]) -> list[httpx.Response]:
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={
                "model": "tiny-llama", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}) for p in prompts))
    return asyncio.run(run())


def test_router_serves_concurrent_clients_on_both_replicas(replicas, model_dir):
    offline = LLM(engine=LLMEngine.from_core(replicas[0])).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    steps_before = [r.stats.num_steps for r in replicas]
    router = ReplicaRouter.over(replicas, max_queued_requests=256).start()
    try:
        with serve_in_thread(server_state(router, model_dir)) as live:
            responses = completions(live.url, PROMPTS)
            health = httpx.get(f"{live.url}/health")
            metrics = httpx.get(f"{live.url}/metrics")
    finally:
        router.stop()
    assert [r.status_code for r in responses] == [200] * len(PROMPTS)
    assert [r.json()["choices"][0]["text"] for r in responses] == [o.outputs[0].text for o in offline]
    assert all(r.stats.num_steps > before for r, before in zip(replicas, steps_before))  # both replicas worked
    assert router.loads == [0, 0]  # every request released its replica
    assert health.status_code == 200 and metrics.status_code == 200


def test_router_admission_limit_is_shared(replicas, model_dir):
    router = ReplicaRouter.over(replicas, max_queued_requests=0).start()
    try:
        with serve_in_thread(server_state(router, model_dir)) as live:
            response = completions(live.url, PROMPTS[:1])[0]
    finally:
        router.stop()
    assert response.status_code == 429
