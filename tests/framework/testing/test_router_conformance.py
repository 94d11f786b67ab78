"""servelab.testing.check_router passes on every registered router and catches broken ones."""

from __future__ import annotations

import random

import pytest

from framework import hookimpl, registry
from framework.interfaces.router import Router
from servelab.testing import check_router


@pytest.mark.parametrize("name", sorted(registry.available("router")))
def test_registered_routers_pass_the_contract(name):
    check_router(registry.get_class("router", name))


def test_a_router_choosing_a_dead_replica_is_caught():
    class Blind(Router):
        name = "blind"

        def route(self, request_id, prompt_token_ids, replicas):
            return replicas[-1].replica_id

    with pytest.raises(AssertionError, match="alive"):
        check_router(Blind)


def test_an_unseeded_router_is_caught():
    class Unseeded(Router):
        name = "unseeded"

        def __init__(self, seed: int = 0) -> None:
            super().__init__(seed)
            self.own = random.Random()

        def route(self, request_id, prompt_token_ids, replicas):
            return self.own.choice([r for r in replicas if r.alive]).replica_id

    with pytest.raises(AssertionError, match="same seed"):
        check_router(Unseeded)


def test_a_third_party_router_registers_through_register_routers():
    class FirstAlive(Router):
        name = "first_alive"

        def route(self, request_id, prompt_token_ids, replicas):
            return next(r.replica_id for r in replicas if r.alive)

    class Plugin:
        @hookimpl
        def register_routers(self, register):
            register("first_alive", FirstAlive)

    with registry.registered(Plugin(), name="test-first-alive"):
        assert "first_alive" in registry.choices("router")
        router = registry.create("router", "first_alive", seed=1)
        check_router(type(router))
    assert "first_alive" not in registry.choices("router")
