"""Multi-LoRA serving through the real server (``python run.py mode=serve`` subprocess: a data-parallel front over two
engine-core processes, stories260K with PEFT adapters made at test time), driven by the official ``openai`` client: the ``model``
field picks the adapter and greedy outputs equal offline ``LLM.generate(lora_request=...)``; ``/v1/models`` lists
the adapters with their ``parent``; an unknown adapter is vLLM's 404; an adapter loaded at run time serves, then is
unloaded; a bad folder is a 400 and the server serves on; ``servelab:lora_requests_info`` is on ``/metrics``. One
server for the module; runtime updates switched off are checked on the app in-process (no second server)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
peft = pytest.importorskip("peft")
from helpers import EAGER_KERNEL, REPO, STORIES, STORY_PROMPTS, free_port, wait_healthy  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from framework import LoRARequest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
PROMPTS = STORY_PROMPTS[:3]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
TARGETS = {"a1": (4, ["q_proj", "v_proj"]), "a2": (8, ["o_proj", "gate_proj", "down_proj"]),
           "a3": (2, ["k_proj", "up_proj"]), "too_big": (16, ["q_proj"])}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """PEFT adapter folders by name (random A and B); ``too_big`` has rank 16, above the server's 8."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("served_adapters")
    for i, (name, (rank, targets)) in enumerate(TARGETS.items(), start=1):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
        peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=16, target_modules=targets,
                                                  init_lora_weights=False)).save_pretrained(root / name)
    return {name: str(root / name) for name in TARGETS}


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapters):
    tmp = tmp_path_factory.mktemp("serve_lora")
    (tmp / "chat.jinja").write_text(TEMPLATE)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "run.py", "mode=serve", "model=stories260K", "engine.compile=false", EAGER_KERNEL,
           f"server.port={port}", "tracker=none", "server.log_level=warning", f"hydra.run.dir={tmp / 'run'}",
           f"server.chat_template={tmp / 'chat.jinja'}",
           "lora.enable=true", "parallel.data_parallel_size=2", "lora.max_loras=2", "lora.max_lora_rank=8", "lora.allow_runtime_updates=true",
           "scheduler=lora_affinity", f"+lora.modules.a1={adapters['a1']}", f"+lora.modules.a2={adapters['a2']}"]
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log, timeout_s=180)
    yield base
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    log.close()


@pytest.fixture(scope="module")
def offline(adapters):
    """``(prompts, LoRARequest or None) -> greedy texts`` from an offline engine of the server's LoRA shape."""
    from framework import LLM, SamplingParams

    llm = LLM(model=STORIES, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def generate(prompts, lora):
        return [o.outputs[0].text for o in llm.generate(prompts, params, lora_request=lora)]

    generate.tokenizer = llm.get_tokenizer()
    return generate


def _client(base: str):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _texts(client, model: str, prompts: list[str]) -> list[str]:
    resp = client.completions.create(model=model, prompt=prompts, max_tokens=12, temperature=0.0)
    assert resp.model == model
    return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]


def test_models_lists_adapters_with_their_parent(server, adapters):
    cards = {m.id: m for m in _client(server).models.list().data}
    assert list(cards) == ["stories260K", "a1", "a2"]
    assert cards["stories260K"].parent is None
    assert (cards["a1"].parent, cards["a1"].root) == ("stories260K", adapters["a1"])
    assert cards["a2"].parent == "stories260K"


def test_model_field_picks_the_adapter_and_outputs_equal_offline(server, adapters, offline):
    client = _client(server)
    got = {name: _texts(client, name, PROMPTS) for name in ("a1", "stories260K", "a2")}
    assert got["a1"] == offline(PROMPTS, LoRARequest("a1", 1, adapters["a1"]))  # ids: places in the sorted names
    assert got["a2"] == offline(PROMPTS, LoRARequest("a2", 2, adapters["a2"]))
    assert got["stories260K"] == offline(PROMPTS, None)
    assert got["a1"] != got["stories260K"] and got["a2"] != got["a1"]  # the adapters do change the output
    stream = client.completions.create(model="a2", prompt=PROMPTS[0], max_tokens=12, temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == got["a2"][0]


def test_chat_picks_the_adapter_too(server, adapters, offline):
    resp = _client(server).chat.completions.create(model="a2", messages=[{"role": "user", "content": "Once upon"}],
                                                   max_tokens=12, temperature=0.0)
    ids = offline.tokenizer("user: Once upon\nassistant:", add_special_tokens=False).input_ids
    assert resp.model == "a2"
    assert resp.choices[0].message.content == offline([{"prompt_token_ids": ids}],
                                                      LoRARequest("a2", 2, adapters["a2"]))[0]


def test_unknown_adapter_is_vllms_404(server):
    with pytest.raises(openai.NotFoundError) as info:
        _client(server).completions.create(model="nope", prompt="Once", max_tokens=2)
    assert info.value.body == {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                               "param": None, "code": 404}


def test_load_use_and_unload_an_adapter_at_run_time(server, adapters, offline):
    client = _client(server)
    resp = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": adapters["a3"]},
                      timeout=60)
    assert resp.status_code == 200 and "a3" in resp.text, resp.text
    assert {m.id: m.parent for m in client.models.list().data}["a3"] == "stories260K"
    assert _texts(client, "a3", PROMPTS) == offline(PROMPTS, LoRARequest("a3", 3, adapters["a3"]))
    again = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": adapters["a3"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    resp = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, timeout=60)
    assert resp.status_code == 200, resp.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a3", prompt="Once", max_tokens=2)
    gone = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


def test_a_bad_folder_is_a_400_and_the_server_serves_on(server, adapters, offline, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")
    for path, why in [(str(tmp_path / "missing"), ""), (str(tmp_path), ""), (adapters["too_big"], "16")]:
        resp = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"].startswith("cannot load LoRA adapter 'bad'") and why in resp.text
    assert "bad" not in [m.id for m in _client(server).models.list().data]
    assert _texts(_client(server), "a1", PROMPTS[:1]) == offline(PROMPTS[:1], LoRARequest("a1", 1, adapters["a1"]))


def test_lora_requests_info_gauge_on_metrics(server):
    _texts(_client(server), "a1", PROMPTS[:1])
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server + "/metrics", timeout=10).text)}
    samples = families["servelab:lora_requests_info"].samples
    assert len(samples) == 1  # one series: the latest adapters
    labels = samples[0].labels
    assert labels["max_lora"] == "2" and {"running_lora_adapters", "waiting_lora_adapters"} <= set(labels)
    assert abs(samples[0].value - time.time()) < 600  # seconds since the epoch of the latest publication
    routed = families["servelab:replica_num_requests_routed"].samples
    assert len(routed) == 2 and all(s.value > 0 for s in routed)  # both replicas served adapter requests


def test_runtime_updates_off_or_lora_off_are_clear_errors():
    from framework.entrypoints.server.app import build_app
    from framework.entrypoints.server.served_models import ServedModels
    from framework.entrypoints.server.serving import ServerState

    def call(models: ServedModels, path: str, body: dict) -> httpx.Response:
        state = ServerState(llm=None, model_name="tiny", max_model_len=256, vocab_size=512, tokenizer=None,
                            supports_structured_outputs=False, models=models)

        async def go():
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.post(path, json=body)

        return asyncio.run(go())

    off = ServedModels("tiny", STORIES, 256, enable_lora=True, allow_runtime_updates=False)
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        body = {"lora_name": "x", "lora_path": "/x"} if path.endswith("/load_lora_adapter") else {"lora_name": "x"}
        resp = call(off, path, body)
        assert resp.status_code == 404 and "lora.allow_runtime_updates=true" in resp.json()["error"]["message"]
    no_lora = ServedModels("tiny", STORIES, 256, enable_lora=False, allow_runtime_updates=True)
    resp = call(no_lora, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})
    assert resp.status_code == 400 and "lora.enable=true" in resp.json()["error"]["message"]
    resp = call(off, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert resp.status_code == 404  # the switch is checked first, as vLLM has no such route then
    unused = ServedModels("tiny", STORIES, 256, enable_lora=False, lora_modules={"a1": "/x"})
    assert [card["id"] for card in unused.cards()] == ["tiny"]  # lora.modules without lora.enable: not served
