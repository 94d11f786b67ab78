"""CPU swap space bookkeeping for ``engine.preemption_mode=swap`` (Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention", SOSP'23, Sec. 4.5: swapping).

The scheduler decides *which* blocks move; the model runner (through the attention backend, which
owns the KV tensors) performs the copies at the start of the step, all swap-outs before all
swap-ins and both before the forward, so a freed device block is copied out before any request
of the same step can overwrite it. Swap slots read by a swap-in are released only after the step,
so a swap-out in the same step cannot overwrite them first.
"""

from __future__ import annotations


class SwapSpace:
    """A bounded pool of CPU swap slots, one slot per KV block (all layers).

    Args:
        num_slots: blocks the swap space holds (``swap_space_bytes // bytes per block``).

    Raises:
        ValueError: ``num_slots < 1``.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"swap space holds no KV block (num_slots={num_slots}); raise engine.swap_space_bytes")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # stack; pops the lowest slot first
        self._held: dict[str, list[int]] = {}  # swapped-out request -> its slots, in block order
        self._releasing: list[int] = []  # slots read by this step's swap-ins, free after the step

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    @property
    def num_free_slots(self) -> int:
        """Slots available for a swap-out now."""
        return len(self._free)

    def swap_out(self, request_id: str, num_blocks: int) -> list[int] | None:
        """Reserve ``num_blocks`` slots for ``request_id``; ``None`` (nothing changed) when full."""
        if num_blocks > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(num_blocks)]
        self._held[request_id] = slots
        return slots

    def swap_in(self, request_id: str) -> list[int]:
        """The request's slots, to copy back this step; they are freed by :meth:`end_step`."""
        slots = self._held.pop(request_id)
        self._releasing.extend(slots)
        return slots

    def drop(self, request_id: str) -> None:
        """Forget a swapped-out request that finished or was aborted while swapped (slots freed)."""
        self._free.extend(self._held.pop(request_id, []))

    def end_step(self) -> None:
        """Release the slots this step's swap-ins read (called once the step's copies are done)."""
        self._free.extend(self._releasing)
        self._releasing.clear()
