"""ThreadedHookRelay: hooks return at once, the observer gets every call in order on another thread."""

from __future__ import annotations

import threading

from framework import registry
from framework.entrypoints.hook_relay import ThreadedHookRelay


class GatedObserver:
    """An observer whose step logging blocks until ``gate`` opens (a stand-in for slow W&B logging)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[tuple[str, object]] = []
        self.threads: set[str] = set()

    def on_step_end(self, stats):
        self.gate.wait(10)
        self.calls.append(("on_step_end", stats))
        self.threads.add(threading.current_thread().name)

    def on_run_end(self, summary):
        self.calls.append(("on_run_end", summary))

    def on_request_finished(self, output):
        raise RuntimeError("observer bug")  # logged, later calls still delivered


def test_relay_does_not_block_and_delivers_in_order():
    observer = GatedObserver()
    relay = ThreadedHookRelay(observer)
    with registry.registered(relay, name="relay-test"):
        hook = registry.plugin_manager().hook
        for step in range(5):
            hook.on_step_end(stats=step)
        hook.on_request_finished(output=None)
        hook.on_engine_start(config={})  # observer has no such method: skipped
        hook.on_run_end(summary={"x": 1})
        assert observer.calls == []  # the hooks returned while the observer is still blocked
        observer.gate.set()
    relay.close()
    assert observer.calls == [("on_step_end", i) for i in range(5)] + [("on_run_end", {"x": 1})]
    assert observer.threads == {"servelab-hook-relay"}
