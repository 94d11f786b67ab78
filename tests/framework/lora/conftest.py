"""The PEFT adapters and oracle fixtures (``tests/lora_peft.py``) for every multi-LoRA test here."""

from lora_peft import adapters, oracle  # noqa: F401 - fixtures
