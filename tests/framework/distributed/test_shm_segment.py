"""Segments a crash cannot leave behind: a memfd segment has no name and passes to a spawned child; owned names
say their creator, and the start-up sweep removes exactly the segments of dead servelab creators in this pid
namespace (never another program's, a live creator's, or another namespace's)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from framework.distributed import shm_segment
from framework.distributed.shm_segment import AnonymousSegment, owned_name, sweep_stale_segments


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_owned_names_say_their_creator_and_fit_macos():
    name = owned_name("tp")
    ns = shm_segment._pid_namespace()  # "" on macOS, whose names stop at 30 characters
    assert name.startswith(f"servelab_{os.getpid()}_") and len(name) <= (30 if not ns else 40)
    assert shm_segment._creator(name) == (os.getpid(), shm_segment._pid_namespace())
    assert shm_segment._creator("psm_1234abcd") is None and shm_segment._creator("servelab_x_1") is None


def test_the_sweep_removes_only_dead_servelab_creators_segments_of_this_namespace(tmp_path):
    ns = shm_segment._pid_namespace()
    dead, live = _dead_pid(), os.getpid()
    stale = f"servelab_{dead}_{ns}_tpabc123"
    kept = [f"servelab_{live}_{ns}_tpabc123",  # a live creator
            f"servelab_{dead}_{'0' * 8 if ns != '0' * 8 else '1' * 8}_tpabc123",  # another pid namespace
            "psm_0123abcd", "sem.mp-abcdefgh", "servelab_notapid_x"]  # another program's
    for name in [stale, *kept]:
        (tmp_path / name).write_bytes(b"")
    assert sweep_stale_segments(tmp_path) == [stale]
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert sweep_stale_segments(tmp_path / "missing") == []  # no /dev/shm to list (macOS): nothing to do


def _child(segment: AnonymousSegment, conn) -> None:
    mapping = segment.map()
    segment.close()  # the mapping keeps the memory
    conn.send(bytes(mapping.buf[:5]))
    mapping.buf[5:10] = b"child"
    mapping.close()


def test_a_memfd_segment_has_no_name_and_reaches_a_spawned_child():
    before = set(os.listdir("/dev/shm"))
    segment = AnonymousSegment(4096)
    assert segment.name is None
    mapping = segment.map()
    mapping.buf[:5] = b"hello"
    ctx = mp.get_context("spawn")
    answers, answer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(segment, answer))
    proc.start()
    answer.close()
    assert answers.poll(30) and answers.recv() == b"hello"
    proc.join(30)
    assert proc.exitcode == 0 and bytes(mapping.buf[5:10]) == b"child"
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("servelab_")}
    mapping.close()
    segment.close()
    with pytest.raises(TypeError, match="passes only to a process being started"):
        import pickle

        pickle.dumps(AnonymousSegment(64))


def test_without_memfd_the_segment_has_an_owned_name_until_forget_name(monkeypatch):
    monkeypatch.delattr(os, "memfd_create")
    segment = AnonymousSegment(4096)
    assert segment.name.startswith(f"servelab_{os.getpid()}_")
    assert os.path.exists(f"/dev/shm/{segment.name}")
    owner, other = segment.map(), segment.map()
    owner.buf[:3] = b"abc"
    name = segment.name
    segment.forget_name()  # every user mapped it
    assert not os.path.exists(f"/dev/shm/{name}") and bytes(other.buf[:3]) == b"abc"
    owner.close()
    other.close()
    segment.close()
