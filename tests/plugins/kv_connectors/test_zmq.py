"""``kv_connector=zmq``: a producer engine in a child process keeps its prefills' blocks, a consumer engine here pulls
them over zmq; token-exact (float32 greedy, stories260K) against a plain engine, a prompt shorter than one block, the
conformance kit (transferred blocks bitwise the producer's), an injected pull failure under both policies, a killed
producer, and nothing left behind (blocks, threads, /dev/shm)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from framework import LLM, SamplingParams, registry
from framework.interfaces import KVConnectorRole
from framework.testing import check_kv_connector
from plugins.attention.torch_paged import TorchPagedAttentionBackend
from plugins.kv_connectors import zmq as zmq_plugin
from plugins.kv_connectors.zmq import ZmqConnector

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
MODEL = str(REPO / "models" / "stories260K")
BLOCK = 4
ENGINE = dict(model=MODEL, dtype="float32", compile=False, block_size=BLOCK, num_blocks=128, max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["Once upon a time there was a little girl named Lily who loved to play in the park",
           "Tom had a big red ball and a small dog", "Hi"]  # "Hi": shorter than one block
# three more, no block in common with PROMPTS (the producer's prefix cache would share it between two consumers)
OTHER_PROMPTS = ["Max liked to run after the big ball in the garden with his sister every day",
                 "A small bird sat on the tree and sang", "Yes"]

# The producer engine: prefills PROMPTS (max_tokens=1, as a P/D prefill does), prints their kv_transfer_params as
# one JSON line, then steps until every held block is pulled (or times out) and prints what it still holds.
_PRODUCER = """
import json, sys, threading
from framework import LLM, SamplingParams, registry
from plugins.kv_connectors import zmq as zmq_plugin
engine_kwargs, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def run():
    llm = LLM(**engine_kwargs, kv_connector="zmq", kv_role="kv_producer",
              kv_connector_params={"abort_timeout_s": 60.0})
    engine, params = llm.engine, {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=1))
    while len(params) < len(prompts):
        params.update({o.request_id: o.kv_transfer_params for o in engine.step() if o.finished})
    print(json.dumps([params[str(i)] for i in range(len(prompts))]), flush=True)
    while engine.has_unfinished_requests():
        engine.step()
    engine.runner.kv_connector.connector.close()
    kv = engine.scheduler.kv
    print(json.dumps({"held_blocks": kv.num_blocks - kv.num_free_blocks,
                      "zmq_threads": [t.name for t in threading.enumerate() if "zmq" in t.name]}), flush=True)
if "zmq" in registry.available("kv_connector"):
    run()
else:
    with registry.registered(zmq_plugin, name="zmq_plugin"):
        run()
"""


@pytest.fixture(scope="module", autouse=True)
def zmq_registered():
    """``zmq`` in the registry (through its entry point, or registered here when the install predates it)."""
    if "zmq" in registry.available("kv_connector"):
        yield
    else:
        with registry.registered(zmq_plugin, name="zmq_plugin"):
            yield


_EARLIER_THREADS: set[threading.Thread] = set()  # zmq threads alive before this module (another file's engines)


@pytest.fixture(scope="module", autouse=True)
def earlier_zmq_threads():
    """The zmq threads this module finds running (a file before it under ``--dist loadfile`` may leave an engine
    alive): the checks below ask that this module's connectors leave none of their own."""
    _EARLIER_THREADS.update(t for t in threading.enumerate() if "zmq" in t.name)
    yield


def _new_zmq_threads() -> list[str]:
    """Names of zmq threads started since this module began."""
    return [t.name for t in threading.enumerate() if "zmq" in t.name and t not in _EARLIER_THREADS]


class Producer:
    """A producer engine in a child process (:data:`_PRODUCER`)."""

    def __init__(self, prompts: list[str]) -> None:
        self.shm_before = set(os.listdir("/dev/shm"))  # before the child starts
        self.proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, json.dumps(ENGINE), json.dumps(prompts)],
                                     cwd=REPO, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.params = json.loads(self.proc.stdout.readline())

    def finish(self) -> dict:
        """Wait for the child to free everything; its last report."""
        report = json.loads(self.proc.stdout.readline())
        assert self.proc.wait(timeout=60) == 0
        return report


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _with_params(params: list[dict]) -> list[SamplingParams]:
    return [dataclasses.replace(GREEDY, kv_transfer_params=p) for p in params]


def _consumer(**kwargs) -> LLM:
    params = kwargs.pop("kv_connector_params", {})
    return LLM(**ENGINE, kv_connector="zmq", kv_role="kv_consumer", kv_connector_params=params, **kwargs)


def _close_and_check(llm: LLM) -> None:
    """No block held, the connector's threads gone once closed."""
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, "a finished run still holds KV blocks"
    llm.engine.runner.kv_connector.connector.close()
    assert not _new_zmq_threads()


@pytest.fixture(scope="module")
def plain():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def producer():
    """A producer child that prefilled :data:`PROMPTS`: the exact test pulls from it (the child exits once every
    block is pulled), the killed-producer test then sends its ``kv_transfer_params`` to nobody."""
    producer = Producer(PROMPTS)
    yield producer
    producer.proc.kill()
    producer.proc.wait(timeout=30)


def test_registered_and_bad_params_refused():
    names = []
    zmq_plugin.register_kv_connectors(register=lambda name, cls: names.append((name, cls)))
    assert names == [("zmq", ZmqConnector)]
    with pytest.raises(ValueError, match="pull_timeout_s"):
        ZmqConnector(KVConnectorRole.SCHEDULER, BLOCK, pull_timeout_s=0)
    with pytest.raises(ValueError, match="port"):
        ZmqConnector(KVConnectorRole.SCHEDULER, BLOCK, port=70000)


def test_passes_the_kv_connector_contract():
    backend = TorchPagedAttentionBackend(num_heads=8, num_kv_heads=4, head_size=8, scale=8 ** -0.5, block_size=BLOCK,
                                         dtype=torch.float32, device=torch.device("cpu"))
    check_kv_connector(ZmqConnector, backend, transfer_params=True)


def test_producer_then_consumer_process_is_exact(plain, producer):
    assert [len(p["remote_block_ids"]) for p in producer.params][2] == 0  # "Hi": nothing kept, nothing held
    consumer = _consumer()
    outputs = consumer.generate(PROMPTS, _with_params(producer.params))
    assert _tokens(outputs) == _tokens(plain.generate(PROMPTS, GREEDY))
    loaded = sum(((len(p) - 1) // BLOCK) * BLOCK for p in consumer.engine.tokenizer(PROMPTS[:2]).input_ids)
    assert consumer.engine.scheduler.kv_transfer.external_prefix_cache_hits == loaded > 0
    metrics = consumer.engine.metrics.summary()
    bytes_per_block = consumer.engine.metrics.kv_cache_info["kv_cache_bytes_per_block"]
    assert metrics["num_kv_transfers"] == 2 and metrics["kv_transfer_bytes"] == loaded // BLOCK * bytes_per_block
    assert metrics["kv_transfer_s"] > 0 and metrics["kv_transfer_gb_per_s"] > 0 and metrics["p99_kv_transfer_ms"] > 0
    assert producer.finish() == {"held_blocks": 0, "zmq_threads": []}
    _close_and_check(consumer)
    # zmq over TCP makes no shared-memory segment (sem.mp-*: multiprocessing semaphores of other processes on a
    # shared machine)
    assert {f for f in set(os.listdir("/dev/shm")) - producer.shm_before if not f.startswith("sem.mp-")} == set()


def test_injected_pull_failure_under_both_policies(plain):
    """Each policy's consumer gets its own three prefills of one producer (prompts sharing no block); in each the
    first request asks for a block the producer does not hold: its pull fails, the others load. ``recompute``
    recomputes it, ``fail`` aborts it alone."""
    producer = Producer(PROMPTS + OTHER_PROMPTS)
    for policy, prompts, params in [("recompute", PROMPTS, producer.params[:3]),
                                    ("fail", OTHER_PROMPTS, producer.params[3:])]:
        params = [dict(p) for p in params]
        params[0]["remote_block_ids"] = [params[0]["remote_block_ids"][0], 10_000] + params[0]["remote_block_ids"][2:]
        consumer = _consumer(kv_load_failure_policy=policy)
        outputs = consumer.generate(prompts, _with_params(params))
        want = _tokens(plain.generate(prompts, GREEDY))
        if policy == "recompute":
            assert _tokens(outputs) == want and all(o.error is None for o in outputs)
        else:
            assert outputs[0].outputs[0].finish_reason == "abort" and "failed to load" in outputs[0].error
            assert "the producer refused" in outputs[0].error  # the pull's own error (get_load_error_reasons)
            assert _tokens(outputs[1:]) == want[1:] and all(o.error is None for o in outputs[1:])
        _close_and_check(consumer)
    assert producer.finish()["held_blocks"] == 0  # a failed pull still releases the producer's blocks


def test_killed_producer_is_recomputed(plain, producer):
    """The exact test's producer, killed (run alone, this test kills it holding every block; after the exact test it
    has exited already): each pull times out against nobody and the consumer recomputes, token for token."""
    producer.proc.kill()
    producer.proc.wait(timeout=30)
    consumer = _consumer(kv_connector_params={"pull_timeout_s": 1.0})
    outputs = consumer.generate(PROMPTS, _with_params(producer.params))
    assert _tokens(outputs) == _tokens(plain.generate(PROMPTS, GREEDY))
    _close_and_check(consumer)


# A producer that dies mid-pull: it receives the pull request, then its process exits without answering.
_DYING_PRODUCER = """
import os, sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
sock.recv_multipart()
os._exit(1)
"""


def test_producer_killed_mid_pull_reports_every_block_bad():
    from plugins.kv_connectors._zmq_wire import Pull
    from plugins.kv_connectors.zmq import ZmqMetadata

    proc = subprocess.Popen([sys.executable, "-c", _DYING_PRODUCER], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    backend = TorchPagedAttentionBackend(num_heads=8, num_kv_heads=4, head_size=8, scale=8 ** -0.5, block_size=BLOCK,
                                         dtype=torch.float32, device=torch.device("cpu"))
    caches = [torch.zeros(backend.get_kv_cache_shape(8)) for _ in range(2)]
    worker = ZmqConnector(KVConnectorRole.WORKER, BLOCK, kv_role="kv_consumer", pull_timeout_s=1.0)
    worker.register_kv_caches(caches, backend)
    worker.bind_connector_metadata(ZmqMetadata(pulls=[Pull("c0", "p0", "127.0.0.1", port, [0, 1, 2], [5, 6, 7])]))
    worker.start_load_kv()
    recving: set[str] = set()
    for _ in range(400):
        recving |= worker.get_finished(set())[1] or set()
        if recving:
            break
        time.sleep(0.01)
    assert recving == {"c0"} and worker.get_block_ids_with_load_errors() == {5, 6, 7}
    assert worker.get_kv_connector_stats() is None  # a failed pull is no transfer in the metrics
    assert proc.wait(timeout=10) == 1
    worker.close()
    assert not _new_zmq_threads()
