"""The simulator (``executor=sim``): fidelity against the real engine, routers and schedulers at scale."""
