"""Built-in LoRA backends: a step's batched LoRA term (``lora_backend=<name>``, with ``lora.enable=true``)."""
