"""LoRA adapters through the real server and the official `openai` client: `model` picks an adapter (streamed and
not, equal to the offline engine with a LoRARequest), /v1/models lists adapters with their parent, runtime load
and unload behind their flag and the API key, unknown names are OpenAI's 404."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.llm import LLM
from jaxserve.lora import LoRARequest
from jaxserve.sampling_params import SamplingParams
from lora_adapters import write_adapter
from test_server_harness import SMALL_ENGINE, running_engine, serve_in_thread, server_state

KEY = "sekret"
PROMPT = "The engineer wrote a test first, and"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("llama3.1")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    cfg = ModelConfig.load(model_dir)
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": write_adapter(root / "sql", cfg, rank=4, seed=1, std=0.5),
            "poem": write_adapter(root / "poem", cfg, rank=8, seed=2, std=0.5, modules=("q_proj", "v_proj", "down_proj"))}


@pytest.fixture(scope="module")
def offline(model_dir, adapters):
    config = SMALL_ENGINE.replace(enable_lora=True, max_loras=2, max_lora_rank=8,
                                  lora_modules=(f"sql={adapters['sql']}",))
    engine = LLMEngine.from_model_dir(model_dir, config, show_progress=False)
    llm = LLM(engine=engine)
    base, sql, poem = llm.generate([PROMPT] * 3, GREEDY, lora_request=[
        None, LoRARequest("sql", 1, str(adapters["sql"])), LoRARequest("poem", 2, str(adapters["poem"]))])
    engine.core.remove_lora("poem")  # the server test loads it at run time
    return {"engine": engine, "base": base.outputs[0].text, "sql": sql.outputs[0].text,
            "poem": poem.outputs[0].text}


@pytest.fixture(scope="module")
def servers(offline, model_dir):
    """The same engine behind two servers: one allows runtime LoRA updating and has an API key, one neither."""
    with running_engine(offline["engine"]) as engine:
        with serve_in_thread(server_state(engine, model_dir, api_key=KEY, allow_runtime_lora_updating=True)) as on:
            with serve_in_thread(server_state(engine, model_dir)) as off:
                yield on, off


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def test_adapters_change_the_text(offline):
    assert len({offline["base"], offline["sql"], offline["poem"]}) == 3


def test_model_field_picks_the_adapter_streamed_and_not(servers, offline):
    on, _ = servers
    c = client(on)
    for model, expected in (("tiny-llama", offline["base"]), ("sql", offline["sql"])):
        done = c.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0)
        assert done.choices[0].text == expected and done.model == model
        chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                           stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
        assert {ch.model for ch in chunks} == {model}


def test_models_lists_adapters_with_their_parent(servers, adapters):
    on, _ = servers
    models = {m.id: m for m in client(on).models.list().data}
    assert models["sql"].parent == "tiny-llama" and models["sql"].root == str(adapters["sql"])
    assert models["tiny-llama"].parent is None


def test_metrics_count_requests_per_adapter(servers):
    on, _ = servers
    client(on).completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    text = httpx.get(f"{on.url}/metrics").text
    assert 'jaxserve:request_success_total{finished_reason="length",model_name="sql"}' in text
    assert any(line.startswith("jaxserve:lora_adapters_loaded{") and line.endswith(" 1.0")
               for line in text.splitlines())


def test_unknown_model_is_a_404_in_openai_format(servers):
    on, _ = servers
    with pytest.raises(openai.NotFoundError) as info:
        client(on).completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and "nope" in error["message"]


def test_load_and_unload_at_run_time(servers, adapters, offline):
    on, _ = servers
    c = client(on)
    load = httpx.post(f"{on.url}/v1/load_lora_adapter", headers=AUTH,
                      json={"lora_name": "poem", "lora_path": str(adapters["poem"])})
    assert load.status_code == 200 and "poem" in load.text
    assert "poem" in {m.id for m in c.models.list().data}
    assert c.completions.create(model="poem", prompt=PROMPT, max_tokens=12, temperature=0.0).choices[0].text == offline["poem"]
    again = httpx.post(f"{on.url}/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "poem", "lora_path": str(adapters["poem"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{on.url}/v1/load_lora_adapter", headers=AUTH,
                     json={"lora_name": "broken", "lora_path": str(adapters["poem"].parent / "missing")})
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
    unload = httpx.post(f"{on.url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "poem"})
    assert unload.status_code == 200 and "removed" in unload.text
    assert "poem" not in {m.id for m in c.models.list().data}
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="poem", prompt=PROMPT, max_tokens=2)
    gone = httpx.post(f"{on.url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "poem"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_adapter_not_found"


def test_unloading_an_adapter_in_use_is_refused(servers, offline, monkeypatch):
    on, _ = servers
    core = offline["engine"].core
    step = core.step
    monkeypatch.setattr(core, "step", lambda: time.sleep(0.02) or step())  # the request must outlive the unload
    with httpx.Client(base_url=on.url, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 200,
                                                          "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()  # kept: a closed line iterator closes the response (the client left)
            next(line for line in lines if line.startswith("data:"))  # a token: it is running
            busy = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"]
    assert "sql" in {m["id"] for m in httpx.get(f"{on.url}/v1/models", headers=AUTH).json()["data"]}


def test_runtime_updating_needs_the_flag_and_the_key(servers, adapters):
    on, off = servers
    body = {"lora_name": "poem", "lora_path": str(adapters["poem"])}
    no_key = httpx.post(f"{on.url}/v1/load_lora_adapter", json=body)
    assert no_key.status_code == 401
    no_flag = httpx.post(f"{off.url}/v1/load_lora_adapter", json=body)
    assert no_flag.status_code == 404 and "--allow-runtime-lora-updating" in no_flag.json()["error"]["message"]
    assert httpx.post(f"{off.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
    assert "poem" not in {m["id"] for m in httpx.get(f"{off.url}/v1/models").json()["data"]}
