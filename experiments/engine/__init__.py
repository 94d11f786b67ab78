"""Inside the engine: attention, layer stack, LM head, packed weights, profiles, compile break-even, KV memory."""
