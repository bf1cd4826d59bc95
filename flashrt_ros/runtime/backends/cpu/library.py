"""The package's small C library (``src/row_product.c``, ``src/delta_step.c``,
``src/transpose_cast.c``, ``src/delta_train.c``), loaded with ctypes: the CPU backend's kernels.

colcon (CMakeLists.txt) installs it as ``_native.so`` in the ``flashrt_ros`` package folder;
``pip install`` (setup.py) builds it with the ABI tag in its name. It is optional: where it is
not built, the engine runs the torch reference path and says so.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it is not built or cannot be loaded."""
    import flashrt_ros   # its __path__: the package folder, and the installed one from a source checkout

    for path in [p for folder in flashrt_ros.__path__ for p in sorted(Path(folder).glob("_native*.so"))]:
        try:
            return ctypes.CDLL(str(path))
        except OSError as exc:
            log.warning("cannot load %s (%s): torch does its work instead", path, exc)
    return None


def kernel(name: str, argtypes: list, family: str = "",
           restype: type | None = None) -> tuple[Callable, str] | None:
    """``flashrt_<name>`` with its argument types, and the version journals record of it
    (``flashrt_<family>_version``, the family being the C file's kernels, by default the
    kernel alone), or None where the library, the kernel or its version is missing."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, f"flashrt_{name}", None)
    version = getattr(lib, f"flashrt_{family or name}_version", None)
    if fn is None or version is None:
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn, str(version())


def check_float_tensors(what: str, expected: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> None:
    """ValueError unless each tensor is a contiguous float32 CPU tensor of its shape: what a
    kernel reads and writes by address must be exactly there."""
    for name, (t, shape) in expected.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
            raise ValueError(f"{what}: {name} must be a contiguous float32 CPU tensor of shape {shape}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def check_rows(what: str, rows: torch.Tensor, width: int) -> torch.Tensor:
    """``rows`` as contiguous float32 CPU rows [n >= 1, width] (ValueError if they are not)."""
    if rows.dtype != torch.float32 or rows.device.type != "cpu" or rows.dim() != 2 or rows.shape[0] < 1 \
            or rows.shape[1] != width:
        raise ValueError(f"{what} takes float32 CPU rows of {width}, got {rows.dtype} {tuple(rows.shape)} "
                         f"on {rows.device}")
    return rows.contiguous()
