"""transformers' conventions at specref's boundary.

    generation.py  GenerationConfig in (one call's settings resolved), stop strings, sequences out
    processors.py  context-reading logits processors, applied per draft position and per tree path
    compat.py      the transformers versions specref runs on, checked when a cache or target is built
    hooks.py       the extras behind one object the loop calls at fixed points (streamer, stop strings, max_time, ...)
"""
from .compat import TransformersVersionError, check_transformers

__all__ = ["TransformersVersionError", "check_transformers"]
