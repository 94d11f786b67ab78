"""Test helpers shared by test modules (imported as ``helpers``; ``tests/`` is on pytest's pythonpath)."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
from pathlib import Path

import pluggy

REPO = Path(__file__).resolve().parents[1]
STORIES = str(REPO / "models" / "stories260K")
STORIES_DRAFT = str(REPO / "models" / "stories260K-draft")
STORIES_EAGLE = str(REPO / "models" / "stories260K-eagle")  # EAGLE-1 head for stories260K (experiments.quality.train_eagle)
#: ``run.py`` override for a subprocess run (``attention=torch_paged``, the default) whose subject is not the attention
#: kernel: the kernel runs eagerly instead of being compiled at start-up, ~5 s of dynamo and inductor per process on
#: 2 cores. The compiled kernel keeps its tests: ``tests/plugins/attention/test_torch_paged.py``, the compile tests
#: and the README's commands as a user types them (``tests/test_first_screen.py``).
EAGER_KERNEL = "attention.params.compile=false"


def make_random_weight_model(path, tokenizer_from: str = STORIES, seed: int = 0) -> str:
    """A random-weight model with ``tokenizer_from``'s config and tokenizer files, saved to ``path`` (float32).

    Random weights sample near-uniform tokens, so byte-fallback tokens form invalid UTF-8 runs often.
    """
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tokenizer_from), dtype=torch.float32)
    model.save_pretrained(path)
    for f in Path(tokenizer_from).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, Path(path) / f.name)
    return str(path)


def assert_all_blocks_free(engine) -> None:
    """Every KV block is back in the pool and the allocator's invariants hold."""
    kv = engine.kv_allocator
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks leaked"
    if hasattr(kv, "check_invariants"):
        kv.check_invariants()


_ORACLE_MODELS: dict[tuple[str, str], object] = {}
_ORACLE_OUTPUTS: dict[tuple, list[int]] = {}  # memoized greedy continuations


def hf_greedy(model_path: str, prompt_ids: list[list[int]], max_new_tokens: int, dtype: str = "float32") -> list[list[int]]:
    """transformers ``generate`` greedy continuations, one prompt at a time (no padding effects)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = (model_path, dtype)
    if key not in _ORACLE_MODELS:
        _ORACLE_MODELS[key] = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    model = _ORACLE_MODELS[key]
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            cache_key = (model_path, dtype, tuple(ids), max_new_tokens)
            if cache_key not in _ORACLE_OUTPUTS:
                seq = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
                _ORACLE_OUTPUTS[cache_key] = seq[0, len(ids):].tolist()
            outs.append(_ORACLE_OUTPUTS[cache_key])
    return outs


STORY_PROMPTS = [
    "Once upon a time",
    "Lily",
    "The dog ran to the park and",
    "One day, a little boy named Tim went to the store with his mom. He saw a big red ball",
    "There was a cat.",
    "Tom and Sue were friends. They liked to play in the garden. One day they found a small bird that could not fly. "
    "Sue said, \"We have to help the bird!\" Tom nodded and",
    "The sun was hot",
    "Once upon a time, in a small town, there lived a kind old man who had a garden full of flowers. Every morning he",
    "Max had a toy car",
    "Mom said, \"Time for bed.\" But Ben did not want to sleep. He wanted to",
    "A big fish swam in the sea. It was very hungry and looked for food. Then it saw a",
    "Anna liked to draw. She drew a sun, a tree and a house. Her dad came home and",
    "The bird",
    "It was a rainy day. Sam could not go outside. He was sad and bored. His sister had an idea: let's build a fort with "
    "blankets and chairs! They worked hard and",
    "Zoe found a shiny key under her bed.",
    "The little bear wanted honey. He climbed the tall tree, but the bees",
    "Once upon a time there was a girl who loved to sing",
]
SHARED_PREFIX = ("Once upon a time, in a small town, there lived a kind old man who had a garden full of flowers. "
                 "Every morning he watered them and talked to the birds. ")
PREFIX_PROMPTS = [SHARED_PREFIX + tail for tail in
                  ["One day", "He had a dog named Spot.", "A girl came by and asked", "The birds sang", "But then",
                   "His friend Sue", "It was spring and", "The flowers were"]]


def assert_greedy_parity(llm, prompts: list[str], priority: list[int] | None = None, max_tokens: int = 24,
                         model_path: str = STORIES) -> list:
    """Greedy ``llm.generate`` equals transformers ``generate`` token for token for every prompt."""
    from framework import SamplingParams

    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, priority=priority)
    expected = hf_greedy(model_path, ids, max_tokens)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers"
    return outs


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a test server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, base: str, log, timeout_s: float = 180.0) -> None:
    """Poll ``base + "/health"`` until it answers 200.

    Raises:
        AssertionError: the server process ``proc`` exited first (the tail of ``log``, a file opened
            ``w+``, in the message) or ``timeout_s`` seconds passed.
    """
    import contextlib
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(f"server exited with {proc.returncode}:\n{log.read()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"server did not become healthy in {timeout_s:.0f} s"
        time.sleep(0.3)


def mapped_shm(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` segments the live processes ``pids`` map now (names; unlinked ones included): what a
    test checks is gone after those processes end, without comparing the whole folder, which other tests
    running at the same time fill too."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names |= {line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)") for line in maps.splitlines()
                  if "/dev/shm/" in line}
    return names


def memfd_mapped(pid: int) -> bool:
    """Whether the live process ``pid`` maps a ``memfd_create`` segment of ours (``/memfd:servelab``)."""
    try:
        return "/memfd:servelab" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def resources_gone(pids: list[int], shm_names: list[str] = (), within_s: float = 10.0) -> bool:
    """Every pid has exited (or is a zombie) and no named segment is left in /dev/shm, within ``within_s``."""
    import time

    def status(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/status").read_text().lower()
        except OSError:
            return "zombie"

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if "zombie" not in status(p)]
        if not alive and not any((Path("/dev/shm") / name).exists() for name in shm_names if name):
            return True
        time.sleep(0.1)
    return False


def run_ranks(target, world: int, *args) -> dict[int, dict]:
    """Run ``target(rank, world, port, queue, *args)`` in ``world`` child processes (a free rendezvous ``port``)
    and collect what each put on ``queue`` as ``(rank, result dict)``; a rank that reported ``{"traceback": ...}``
    fails the test with it."""
    from framework.distributed.process_start import process_context

    ctx = process_context()  # forked from a server that imported torch once (spawn where there is none)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, queue, *args)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, res in results.items():
        assert "traceback" not in res, f"rank {rank}:\n{res['traceback']}"
    return results


_hookimpl = pluggy.HookimplMarker("servelab")  # framework.hookimpl, without importing torch here


class HookRecorder:
    """A lifecycle-hook plugin that records what the engine told it: ``started`` (the configs of
    ``on_engine_start``), ``steps`` (``on_step_end`` stats), ``finished`` (request ids of ``on_request_finished``).
    Register it with ``registry.registered(recorder)``."""

    def __init__(self) -> None:
        self.started, self.steps, self.finished = [], [], []

    @_hookimpl
    def on_engine_start(self, config):
        self.started.append(config)

    @_hookimpl
    def on_step_end(self, stats):
        self.steps.append(stats)

    @_hookimpl
    def on_request_finished(self, output):
        self.finished.append(output.request_id)



def servelab_processes(root_pid: int, prefix: str) -> list:
    """``root_pid``'s descendants named ``prefix*`` (``servelab-core`` engine cores, ``servelab-rank`` worker ranks:
    ``set_process_name``), oldest first, as ``psutil.Process`` objects. By name, not by parent: under the fork server
    a child's parent is the server, not its launcher."""
    import psutil

    found = []
    for process in psutil.Process(root_pid).children(recursive=True):
        try:
            if process.name().startswith(prefix):
                found.append(process)
        except psutil.Error:
            continue
    return sorted(found, key=lambda p: p.create_time())


@functools.cache
def sibling_test_module(test_file: str, name: str):
    """Test module ``name`` (a file name) from ``test_file``'s folder, imported once per process: under
    ``--import-mode=importlib`` test files are no package, so one test file reuses another's helpers this way."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, Path(test_file).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smollm2_layout_model(folder: Path, num_hidden_layers: int = 3, tie_word_embeddings: bool = False) -> str:
    """SmolLM2-135M's head layout (9 query / 3 KV heads: ``tensor_parallel_size`` 1 or 3) in a tiny random-weight
    Llama (``families.COMMON_TINY`` otherwise; hidden 72, head 8) with ``families``' sharpened initialisation (clear
    greedy margins, EOS never wins) and stories260K's tokenizer (vocabulary 512), float32, saved to ``folder``.

    Returns:
        ``str(folder)``, a model path for ``LLM(model=...)`` and :func:`hf_greedy`.
    """
    import shutil

    import torch
    from families import COMMON_TINY, sharpen
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**COMMON_TINY, "hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3,
                            "num_hidden_layers": num_hidden_layers, "tie_word_embeddings": tie_word_embeddings})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sharpen(model)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(STORIES) / name, Path(folder) / name)
    return str(folder)


def run_in_one_process(commands: dict[str, list[str]], workdir: Path, env: dict[str, str] | None = None,
                       timeout: float = 600) -> dict[str, subprocess.CompletedProcess]:
    """Run ``commands`` (name -> argv after ``python``: ``["run.py", ...]`` or ``["-m", "module", ...]``) in order
    in one Python process started in the repository root (``tests/one_process.py``), each as its own
    ``python`` process would run it: returns name -> ``CompletedProcess`` with that command's exit status,
    stdout and stderr. One interpreter start and one import of torch/transformers/Hydra for them all.

    Raises:
        AssertionError: the process running them failed outside any command (its stderr attached).
        subprocess.TimeoutExpired: they took longer than ``timeout`` seconds together.
    """
    import json
    import sys

    workdir.mkdir(parents=True, exist_ok=True)
    cases = [{"argv": argv, "stdout": str(workdir / f"{name}.stdout"), "stderr": str(workdir / f"{name}.stderr")}
             for name, argv in commands.items()]
    (workdir / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "one_process.py"), str(workdir / "cases.json"),
                           str(workdir / "status.json")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = json.loads((workdir / "status.json").read_text())
    return {name: subprocess.CompletedProcess([sys.executable, *case["argv"]], status,
                                              Path(case["stdout"]).read_text(), Path(case["stderr"]).read_text())
            for (name, case), status in zip(zip(commands, cases), statuses)}
