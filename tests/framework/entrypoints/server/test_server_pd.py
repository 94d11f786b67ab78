"""P/D serving in one command (``parallel.data_parallel_size=N disagg.prefill_replicas=P kv_connector=...``): every
router learns the role through ``Router.route_role`` (model-free: each registered router keeps prefill and decode
phases in their pools, and a dead pool is a clear error); the config refusals; and the served form itself: the
server's front (``launch.start_front``) over one prefill and one decode engine-core process (``shared_storage``'s
shared folder, or ``zmq``'s pulls), whose greedy float32 completions, streamed and not, equal one plain engine's token for
token (a prompt shorter than one block included), the decode replica having loaded the prefill's blocks; a request
whose stored KV is corrupt under ``load_failure_policy=fail`` gets an error naming the policy (the others are served);
no engine-core process left after shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os

import pytest

from framework import registry
from framework.config import EngineConfig
from framework.engine.async_llm import PREFILL_KV_TRANSFER_PARAMS, prefill_params
from framework.engine.replica_set import ReplicaSet
from framework.interfaces.router import NoReplicaError, ReplicaState

ROLES = ["prefill", "decode", "prefill", "decode", "decode"]
BROKEN = "The dog and the bird sang a song under the big green tree"


@pytest.mark.parametrize("name", registry.choices("router"))
def test_every_router_keeps_each_phase_in_its_pool(name):
    replicas = ReplicaSet(len(ROLES), registry.create("router", name, seed=0), name, roles=ROLES)
    states = [ReplicaState(i, num_waiting_reqs=i % 2) for i in range(len(ROLES))]
    for k in range(12):
        prompt = [1, 2, 3, k]
        assert ROLES[replicas.choose(f"p{k}", prompt, states, "prefill")] == "prefill"
        assert ROLES[replicas.choose(f"d{k}", prompt, states, "decode")] == "decode"
    dead_decode = [dataclasses.replace(s, alive=ROLES[s.replica_id] == "prefill") for s in states]
    with pytest.raises(NoReplicaError, match="no alive decode replica"):
        replicas.choose("x", [1], dead_decode, "decode")


def test_roles_are_checked_and_a_colocated_set_is_not_disaggregated():
    assert not ReplicaSet(2, registry.create("router", "round_robin")).disaggregated
    assert ReplicaSet(2, registry.create("router", "round_robin"), roles=["prefill", "decode"]).disaggregated
    with pytest.raises(ValueError, match="roles"):
        ReplicaSet(2, registry.create("router", "round_robin"), roles=["prefill", "encode"])


def test_prefill_params_are_the_toy_proxys_prefill():
    from framework.core.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(n=2, max_tokens=30, min_tokens=5, logprobs=3, kv_transfer_params={"x": 1})
    first = prefill_params(params)
    assert (first.n, first.max_tokens, first.min_tokens, first.logprobs) == (1, 1, 0, None)
    assert first.output_kind == RequestOutputKind.FINAL_ONLY
    assert first.kv_transfer_params == {"x": 1, **PREFILL_KV_TRANSFER_PARAMS}


def test_disagg_needs_a_kv_connector_and_fewer_prefill_than_replicas():
    with pytest.raises(ValueError, match="kv_connector=zmq"):
        EngineConfig(model="m", data_parallel_size=2, disagg_prefill_replicas=1, executor="uniproc")
    with pytest.raises(ValueError, match="prefill_replicas must be 0"):
        EngineConfig(model="m", data_parallel_size=2, disagg_prefill_replicas=2, kv_connector="shared_storage",
                     executor="uniproc")


def test_offline_replicas_refuse_disagg():
    from framework.engine.data_parallel import build_data_parallel_engine

    config = EngineConfig(model="m", data_parallel_size=2, disagg_prefill_replicas=1, kv_connector="shared_storage",
                          kv_connector_params={"path": "/nonexistent"}, executor="uniproc")
    with pytest.raises(ValueError, match="servelab serve"):
        build_data_parallel_engine(config)


def test_an_in_process_pd_front_equals_one_plain_engine_and_counts_each_request_once(tmp_path):
    from helpers import STORIES, assert_all_blocks_free

    from framework import LLM, SamplingParams
    from framework.engine.async_llm import AsyncLLM
    from framework.engine.core_client import InprocCoreClient

    engine = dict(model=STORIES, dtype="float32", compile=False, block_size=4, num_blocks=128, max_model_len=128)
    kv = dict(kv_connector="shared_storage", kv_connector_params={"path": str(tmp_path)})
    engines = [LLM(**engine, **kv, kv_role=role).engine for role in ("kv_producer", "kv_consumer")]
    clients = [InprocCoreClient(e) for e in engines]
    clients[1].replica_id = 1

    class Finished:  # the server metrics' two calls; only finished requests are counted here
        def __init__(self):
            self.ids = []

        def observe_stats(self, stats):
            return None  # the replicas' load is not what this test counts

        def observe_finished(self, output):
            self.ids.append(output.request_id)

    metrics = Finished()
    llm = AsyncLLM.from_clients(clients, router=registry.create("router", "least_loaded"), metrics=metrics,
                                roles=["prefill", "decode"])
    prompts = ["Once upon a time there was a little girl named Lily who loved to play", "Hi"]

    async def go():
        outs = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=8)
            outs.append([o async for o in llm.generate(prompt, params, request_id=f"r{i}")][-1])
        return outs

    try:
        outs = asyncio.run(go())
    finally:
        llm.shutdown()
    want = LLM(**engine).generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
    assert llm.num_routed == [2, 2] and sorted(metrics.ids) == ["r0", "r1"]  # the prefill phases are not counted
    assert engines[1].scheduler.kv_transfer.external_prefix_cache_hits > 0
    for e in engines:
        assert_all_blocks_free(e)


@pytest.mark.slow
@pytest.mark.parametrize("connector", ["shared_storage", "zmq"])
def test_one_prefill_and_one_decode_core_equal_one_plain_engine(tmp_path, connector):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    psutil = pytest.importorskip("psutil")
    from helpers import STORIES, resources_gone, servelab_processes
    from omegaconf import OmegaConf

    from framework import LLM, SamplingParams
    from framework.entrypoints.server.app import build_app
    from framework.entrypoints.server.launch import replica_roles, server_state, start_front
    from framework.interfaces.kv_connector import prefix_block_hashes

    engine = dict(model=STORIES, dtype="float32", compile=False, block_size=4, num_blocks=128, max_model_len=128)
    plain = LLM(**engine)
    config = EngineConfig(**engine, attention_params={"compile": False}, data_parallel_size=2,
                          disagg_prefill_replicas=1, router="round_robin", executor="uniproc",
                          kv_connector=connector, kv_load_failure_policy="fail",
                          kv_connector_params={"path": str(tmp_path / "kv")} if connector == "shared_storage"
                          else {"abort_timeout_s": 60.0})
    assert replica_roles(config) == ["prefill", "decode"]
    # shared_storage: a garbage file where BROKEN's second block goes: the prefill keeps it (a stored block is not
    # rewritten), the decode fails to load it (zmq serves BROKEN like any prompt)
    (tmp_path / "kv").mkdir()
    key = prefix_block_hashes(plain.engine.tokenizer(BROKEN).input_ids, 4)[1]
    (tmp_path / "kv" / f"{key}.safetensors").write_bytes(b"not a safetensors file")
    cfg = OmegaConf.create({"server": {"engine_process": True}, "slo": {"ttft_ms": None, "tpot_ms": None},
                            "executor": {"name": "uniproc"}})
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    llm, facts, tokenizer = start_front(cfg, config, on_dead=None, metrics=None)
    cores = [c.pid for c in servelab_processes(os.getpid(), "servelab-core") if c.pid not in before]
    assert len(cores) == 2, cores  # one engine-core process per replica
    try:
        state = server_state(cfg, facts, tokenizer, llm, "tiny", None, api_key=None)
        prompts = ["Once upon a time there was a little girl named Lily who loved to play", "Hi"]

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t",
                                         timeout=120) as client:
                body = {"max_tokens": 8, "temperature": 0}
                plain_ones = [await client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts]
                streamed = await client.post("/v1/completions", json={**body, "prompt": prompts[0] + " ball",
                                                                      "stream": True})
                broken = await client.post("/v1/completions", json={**body, "prompt": BROKEN})
                return plain_ones, streamed, broken

        responses, streamed, broken = asyncio.run(go())
        want = plain.generate([*prompts, prompts[0] + " ball", BROKEN], SamplingParams(temperature=0, max_tokens=8))
        assert [r.json()["choices"][0]["text"] for r in responses] == [w.outputs[0].text for w in want[:2]]
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want[2].outputs[0].text
        if connector == "shared_storage":
            assert broken.status_code >= 400 and "load_failure_policy=fail" in broken.json()["error"]["message"]
        else:
            assert broken.json()["choices"][0]["text"] == want[3].outputs[0].text
        assert llm.num_routed == [4, 4]  # each request: its prefill on replica 0, then its decode on replica 1
        decode_stats = llm._stats[1]
        assert decode_stats.external_prefix_hits_tokens > 0  # the decode replica loaded the prefill's blocks
    finally:
        llm.shutdown()
    assert resources_gone(cores)
