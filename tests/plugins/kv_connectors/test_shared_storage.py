"""``kv_connector=shared_storage``: a producer run then consumer runs, token-exact (float32 greedy, stories260K)
against one plain engine; full, partial and local+external prefix hits, a prompt shorter than one block, transferred
blocks bitwise the producer's, an injected load failure under both policies, and no block leaked."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from framework import LLM, SamplingParams, hookimpl, registry
from framework.interfaces.kv_connector import prefix_block_hashes
from framework.testing import check_kv_connector
from plugins.attention.torch_paged import TorchPagedAttentionBackend
from plugins.kv_connectors.shared_storage import SharedStorageConnector, register_kv_connectors

MODEL = str(Path(__file__).resolve().parents[3] / "models" / "stories260K")
BLOCK = 4
ENGINE = dict(model=MODEL, dtype="float32", compile=False, block_size=BLOCK, num_blocks=128, max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = "Once upon a time there was a little girl named Lily who loved to play in the park"
PROMPTS = [LONG, "Tom had a big red ball and a small dog", "Hi"]  # "Hi": shorter than one block
PARTIAL = LONG.rsplit(" ", 6)[0] + " and one day she found a cat"  # shares LONG's first blocks, then differs


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _connector_llm(path: Path, role: str, **kwargs) -> LLM:
    return LLM(**ENGINE, kv_connector="shared_storage", kv_connector_params={"path": str(path)}, kv_role=role,
               **kwargs)


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, "a finished run still holds KV blocks"


@pytest.fixture(scope="module")
def plain():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def store(tmp_path_factory, plain):
    """The folder a producer filled with PROMPTS; its outputs equal the plain engine's."""
    path = tmp_path_factory.mktemp("kv_store")
    producer = _connector_llm(path, "kv_producer")
    assert _tokens(producer.generate(PROMPTS, GREEDY)) == _tokens(plain.generate(PROMPTS, GREEDY))
    assert producer.engine.scheduler.kv_transfer.external_prefix_cache_hits == 0  # a producer never loads
    _assert_no_leak(producer)
    return path


def test_registered_and_refused_without_a_path():
    names = []
    register_kv_connectors(register=lambda name, cls: names.append((name, cls)))
    assert names == [("shared_storage", SharedStorageConnector)]
    assert registry.get_class("kv_connector", "shared_storage") is SharedStorageConnector
    assert registry.get_class("kv_connector", "none") is None
    with pytest.raises(ValueError, match="kv_connector.params.path"):
        LLM(**ENGINE, kv_connector="shared_storage")


def test_passes_the_kv_connector_contract(tmp_path):
    backend = TorchPagedAttentionBackend(num_heads=8, num_kv_heads=4, head_size=8, scale=8 ** -0.5, block_size=BLOCK,
                                         dtype=torch.float32, device=torch.device("cpu"))
    check_kv_connector(SharedStorageConnector, backend, path=str(tmp_path))


def test_producer_stores_every_full_prompt_block(store, plain):
    tokenizer = plain.engine.tokenizer
    expected = set()
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        expected |= set(prefix_block_hashes(ids, BLOCK))
    assert {p.stem for p in store.glob("*.safetensors")} == expected


def _num_shared_blocks(tokenizer) -> int:
    """Leading blocks of PARTIAL equal to LONG's."""
    shared = 0
    for a, b in zip(prefix_block_hashes(tokenizer(LONG).input_ids, BLOCK),
                    prefix_block_hashes(tokenizer(PARTIAL).input_ids, BLOCK)):
        if a != b:
            break
        shared += 1
    return shared


def test_consumer_is_exact_with_full_hits(store, plain):
    consumer = _connector_llm(store, "kv_consumer")
    assert _tokens(consumer.generate(PROMPTS, GREEDY)) == _tokens(plain.generate(PROMPTS, GREEDY))
    transfer = consumer.engine.scheduler.kv_transfer
    lengths = [len(plain.engine.tokenizer(p).input_ids) for p in PROMPTS]
    assert lengths[2] < BLOCK
    assert transfer.external_prefix_cache_queries == sum(lengths)
    # every block before the last prompt token's (vLLM's rule); "Hi" (shorter than a block): nothing
    assert transfer.external_prefix_cache_hits == sum((n - 1) // BLOCK * BLOCK for n in lengths) > 0
    summary = consumer.engine.metrics.summary()  # what metrics.json holds
    assert summary["external_prefix_cache_queries"] == transfer.external_prefix_cache_queries
    assert summary["external_prefix_cache_hits"] == transfer.external_prefix_cache_hits
    _assert_no_leak(consumer)


def test_consumer_partial_hit(store, plain):
    """PARTIAL loads the blocks it shares with LONG and computes the rest."""
    shared = _num_shared_blocks(plain.engine.tokenizer)
    assert shared >= 2
    consumer = _connector_llm(store, "kv_consumer")
    assert _tokens(consumer.generate([PARTIAL], GREEDY)) == _tokens(plain.generate([PARTIAL], GREEDY))
    assert consumer.engine.scheduler.kv_transfer.external_prefix_cache_hits == shared * BLOCK
    _assert_no_leak(consumer)


def test_local_hit_then_external_blocks(store, plain):
    """The local prefix cache serves PARTIAL's shared blocks; the connector the rest of LONG's."""
    consumer = _connector_llm(store, "kv_consumer")
    tokenizer = plain.engine.tokenizer
    consumer.generate([PARTIAL], GREEDY)
    before = consumer.engine.scheduler.kv_transfer.external_prefix_cache_hits
    assert _tokens(consumer.generate([LONG], GREEDY)) == _tokens(plain.generate([LONG], GREEDY))
    n = len(tokenizer(LONG).input_ids)
    local = consumer.engine.scheduler.kv.stats().prefix_hits_tokens
    assert local > 0
    assert consumer.engine.scheduler.kv_transfer.external_prefix_cache_hits - before == (n - 1) // BLOCK * BLOCK - local
    _assert_no_leak(consumer)


def _block_bytes(runner, block: int) -> list[torch.Tensor]:
    """Block ``block`` of every layer's cache, copied out through the backend."""
    out = []
    for cache in runner.kv_caches:
        buf = torch.empty(runner.backend.get_kv_cache_shape(1), dtype=cache.dtype)
        runner.backend.copy_blocks([cache], [block], [buf], [0])
        out.append(buf)
    return out


def _file_bytes(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(path)
    return [tensors[f"layer.{i}"] for i in range(len(tensors))]


def _first_step_table(llm: LLM, prompt: str) -> list[int]:
    """Add ``prompt``, run one step (its prefill: loads and saves happen), return its block table."""
    engine = llm.engine
    engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    table = list(engine.scheduler.kv.get_block_ids("probe"))
    while engine.has_unfinished_requests():
        engine.step()
    return table


def test_transferred_blocks_are_bitwise_the_producers(tmp_path, plain):
    producer = _connector_llm(tmp_path, "kv_producer")
    src = _first_step_table(producer, LONG)
    keys = prefix_block_hashes(plain.engine.tokenizer(LONG).input_ids, BLOCK)
    consumer = _connector_llm(tmp_path, "kv_consumer")
    dst = _first_step_table(consumer, LONG)
    for i in range(len(keys) - 1):  # the last block holds the last prompt token on a multiple; others all load
        stored = _file_bytes(tmp_path / f"{keys[i]}.safetensors")
        for a, b, c in zip(_block_bytes(producer.engine.runner, src[i]), stored,
                           _block_bytes(consumer.engine.runner, dst[i])):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            assert torch.equal(b.view(torch.uint8), c.view(torch.uint8))


def _corrupted_copy(store: Path, dest: Path, tokenizer) -> Path:
    """A copy of ``store`` whose file of LONG's second block is garbage."""
    shutil.copytree(store, dest)
    key = prefix_block_hashes(tokenizer(LONG).input_ids, BLOCK)[1]
    (dest / f"{key}.safetensors").write_bytes(b"not a safetensors file")
    return dest


def test_load_failure_recompute_is_exact(store, plain, tmp_path):
    path = _corrupted_copy(store, tmp_path / "kv", plain.engine.tokenizer)
    consumer = _connector_llm(path, "kv_consumer", kv_load_failure_policy="recompute")
    outputs = consumer.generate(PROMPTS, GREEDY)
    assert _tokens(outputs) == _tokens(plain.generate(PROMPTS, GREEDY))
    assert all(o.error is None for o in outputs)
    _assert_no_leak(consumer)


def test_load_failure_fail_fails_only_that_request(store, plain, tmp_path):
    path = _corrupted_copy(store, tmp_path / "kv", plain.engine.tokenizer)
    consumer = _connector_llm(path, "kv_consumer", kv_load_failure_policy="fail")
    outputs = consumer.generate(PROMPTS, GREEDY)
    failed, *rest = outputs
    assert failed.outputs[0].finish_reason == "abort" and "failed to load" in failed.error
    assert "load_failure_policy=fail" in failed.error
    key = prefix_block_hashes(plain.engine.tokenizer(LONG).input_ids, BLOCK)[1]
    assert f"{key}.safetensors did not load" in failed.error, "the connector's reason must reach the error"
    assert _tokens(rest) == _tokens(plain.generate(PROMPTS[1:], GREEDY))
    assert all(o.error is None for o in rest)
    _assert_no_leak(consumer)


def test_consumer_preempted_reloads_and_stays_exact(store, plain):
    """A KV cache too small for the batch: the consumer preempts (recompute) and re-admitted requests load again."""
    prompts = PROMPTS + [PARTIAL]
    consumer = LLM(**{**ENGINE, "num_blocks": 12, "max_model_len": 40}, kv_connector="shared_storage",
                   kv_connector_params={"path": str(store)}, kv_role="kv_consumer")
    assert _tokens(consumer.generate(prompts, GREEDY)) == _tokens(plain.generate(prompts, GREEDY))
    assert consumer.engine.metrics.num_preemptions > 0
    _assert_no_leak(consumer)


class _EchoParams(SharedStorageConnector):
    """shared_storage that hands back what the request brought (``SamplingParams.kv_transfer_params``) plus its id."""

    name = "echo_params"

    def request_finished(self, request, block_ids):
        return False, {**(request.sampling_params.kv_transfer_params or {}), "request": request.request_id}


class _EchoPlugin:
    @hookimpl
    def register_kv_connectors(self, register):
        register("echo_params", _EchoParams)


def test_kv_transfer_params_reach_the_output(tmp_path):
    """What a request brings in ``SamplingParams.kv_transfer_params`` reaches the connector; what the connector's
    ``request_finished`` returns reaches the final ``RequestOutput.kv_transfer_params`` (vLLM's fields)."""
    with registry.registered(_EchoPlugin()):
        llm = LLM(**ENGINE, kv_connector="echo_params", kv_connector_params={"path": str(tmp_path)})
        params = SamplingParams(temperature=0, max_tokens=2, kv_transfer_params={"peer": "decode-0"})
        (out,) = llm.generate([LONG], params)
    assert out.finished and out.kv_transfer_params == {"peer": "decode-0", "request": out.request_id}
