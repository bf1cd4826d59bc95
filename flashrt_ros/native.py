"""The package's small C library (``src/*.c``), loaded with ctypes: decode's one-row
products (``runtime.row_product``) and linear-attention mixers (``runtime.delta_step``),
and the capsules' span copies (``capsule.span_copy``).

colcon (CMakeLists.txt) installs it as ``_native.so`` beside this file; ``pip install``
(setup.py) builds it with the ABI tag in its name. It is optional: where it is not built,
each caller falls back to torch and says so.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it is not built or cannot be loaded."""
    for path in sorted(Path(__file__).parent.glob("_native*.so")):
        try:
            return ctypes.CDLL(str(path))
        except OSError as exc:
            log.warning("cannot load %s (%s): torch does its work instead", path, exc)
    return None
