"""Test tooling that plugin packages can import: model-free oracles and conformance checks."""
