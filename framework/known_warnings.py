"""Known-harmless warnings of our dependencies, dropped at import so the first screen is ours (issue 44).

Each entry names the logger, the exact message and why it is harmless; anything else still shows.
``tests/test_first_screen.py`` runs the README's commands and fails on any other ``Warning`` or
``Traceback`` line, so a new dependency warning is seen (and fixed, or added here with its reason).

- ``torchao`` (0.18.0), logged at import by every process that loads transformers (transformers
  imports its torchao quantizer whenever torchao is installed): ``Failed to load .../_C_mxfp8...so``
  (a CPython 3.10 build of the MX-FP8 CUDA kernels) and ``.../_C_cutlass_90a.abi3.so`` (CUTLASS
  kernels for sm_90 GPUs). Neither can load without CUDA, and none of our quant methods uses them
  on CPU; dropped only when ``torch.cuda.is_available()`` is false, so a GPU machine still sees them.
- ``torch.utils._pytree`` (torch 2.13): ``<enum 'KernelPreference'>`` / ``<enum 'ScaleCalculationMode'>``
  ``is an Enum subclass and is now natively supported by torch.compile ... register_constant() on
  Enum subclasses is deprecated``: torchao 0.18 registers these two enums of its own at import;
  a deprecation addressed to torchao, with no effect on us.
"""

from __future__ import annotations

import logging
import re

#: logger name -> (message pattern, needs "no CUDA" to be harmless)
KNOWN_HARMLESS: dict[str, list[tuple[re.Pattern[str], bool]]] = {
    "torchao": [(re.compile(r"^Failed to load \S*/torchao/_C_(mxfp8|cutlass_90a)\S*\.so: "), True)],
    "torch.utils._pytree": [(re.compile(r"^<enum '(KernelPreference|ScaleCalculationMode)'> is an Enum subclass and "
                                        r"is now natively supported by torch\.compile as an opaque value type"), False)],
}


class DropKnownHarmless(logging.Filter):
    """A logger filter that drops the records of :data:`KNOWN_HARMLESS` for its logger, keeps the rest.

    Args:
        patterns: ``(message pattern, only without CUDA)`` pairs of one logger.
    """

    def __init__(self, patterns: list[tuple[re.Pattern[str], bool]]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) when the record's message matches a known-harmless pattern."""
        message = record.getMessage()
        for pattern, only_without_cuda in self.patterns:
            if pattern.search(message) and not (only_without_cuda and _cuda_available()):
                return False
        return True


def _cuda_available() -> bool:
    import torch  # already imported by whoever logs these records

    return torch.cuda.is_available()


def install() -> None:
    """Attach the filters to their loggers (idempotent); runs when ``framework`` is imported, in the
    driver and in every worker process, before transformers imports torchao."""
    for name, patterns in KNOWN_HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropKnownHarmless) for f in logger.filters):
            logger.addFilter(DropKnownHarmless(patterns))
