"""The runtime under faults: the fault-injection matrix."""
