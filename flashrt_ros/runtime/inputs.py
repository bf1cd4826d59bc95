"""What the engine's public calls accept: each check turns a caller's argument into the
value the engine uses, or raises InvalidArgument naming the problem, before any state changes."""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np
import torch

from ..capsule.errors import InvalidCapsuleRequest
from ..errors import InvalidArgument, shown
from .arena import GROUPS
from .sampling import Sampling


def is_int(value: Any) -> bool:
    """An int, NumPy's included; never a bool (True is 1 to Python, and a mistake here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def token_ids(given: Sequence[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One sequence of ids in [0, vocab_size), as int64 [n]."""
    try:
        ids = torch.as_tensor(given)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgument(f"token ids must be a sequence of ints: {exc}") from None
    if ids.numel() == 0:
        raise InvalidArgument("token ids are empty")
    if ids.dim() > 1:   # a batch ([[...], [...]]) flattened would be one long prompt
        raise InvalidArgument(f"token ids must be one sequence (1-D), got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dtype.is_complex:
        raise InvalidArgument(f"token ids must be integers, got dtype {ids.dtype}")
    if isinstance(given, (list, tuple)) and any(isinstance(t, bool) for t in given):
        raise InvalidArgument("token ids must be integers, got a bool among them")   # True would be id 1
    ids = ids.flatten().to(torch.int64)
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        first = int(ids[bad][0])
        raise InvalidArgument(f"token id {first} is out of range [0, {vocab_size}) ({int(bad.sum())} bad ids)")
    return ids


def observation(given: Sequence[float] | torch.Tensor, obs_dim: int) -> torch.Tensor:
    """One vector of ``obs_dim`` finite reals, as float32 [obs_dim]."""
    try:
        values = torch.as_tensor(given)
        if values.is_floating_point() and not isinstance(given, (torch.Tensor, np.ndarray)):
            values = torch.as_tensor(given, dtype=torch.float64)   # Python floats are doubles
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgument(f"observation is not a vector of numbers: {exc}") from None
    if values.dtype == torch.bool or values.dtype.is_complex or values.dim() > 1:
        raise InvalidArgument(f"observation must be a vector (1-D) of real numbers, got {values.dtype} "
                              f"of shape {tuple(values.shape)}")
    if values.numel() != obs_dim:
        raise InvalidArgument(f"observation has {values.numel()} values, the model expects obs_dim={obs_dim}")
    if not torch.isfinite(values).all():
        raise InvalidArgument("observation contains NaN or infinity")
    obs = values.to(torch.float32).flatten()
    if not torch.isfinite(obs).all():
        raise InvalidArgument(f"observation value {values.abs().max().item():.3g} is out of float32's range")
    return obs


def device(given: str | torch.device) -> torch.device:
    """A CPU, or a CUDA device this process can see."""
    try:
        dev = torch.device(given)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgument(f"device must be 'cpu', 'cuda' or 'cuda:N', got {shown(given)}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(f"device {dev} asked for, but this torch build sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidArgument(f"device {dev}: there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise InvalidArgument(f"device {dev}: this engine runs on 'cpu' or 'cuda'")
    return dev


# float64 is there to check the arithmetic itself against a float64 reference.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def dtype(given: Any) -> torch.dtype:
    """One of the dtypes the engine computes in."""
    if given not in DTYPES:
        raise InvalidArgument(f"dtype {given} is not supported ({', '.join(map(str, DTYPES))})")
    return given


def max_seq_len(value: Any) -> int:
    """The positions an engine's state holds: an int >= 1."""
    if not is_int(value) or value < 1:
        raise InvalidArgument(f"max_seq_len must be a positive int, got {value!r}")
    return int(value)


def check_seed(seed: Any) -> None:
    if not is_int(seed) or not 0 <= seed < 2**63:   # it names the seeded weights: 1.5 and "1.5" are not seeds
        raise InvalidArgument(f"seed must be an int in [0, 2**63), got {shown(seed)}")


def optional_seed(seed: Any) -> int | None:
    """A seed (``check_seed``), or None."""
    if seed is not None:
        check_seed(seed)
    return seed


def checked_temperature(value: Any) -> float:
    """Of sampling: a finite number >= 0, where 0 means greedy."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"temperature must be a finite number >= 0 (0: greedy), got {shown(value)}")
    return float(value)


def sampling(temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0) -> Sampling:
    """Checked sampling values (``sampling.Sampling``), or InvalidArgument naming the one refused."""
    if not is_int(top_k) or not 0 <= top_k < 2**31:
        raise InvalidArgument(f"top_k must be an int >= 0 (0: no top-k cut), got {shown(top_k)}")
    if (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not math.isfinite(top_p)
            or not 0 < top_p <= 1):
        raise InvalidArgument(f"top_p must be a number in (0, 1] (1: no nucleus cut), got {shown(top_p)}")
    return Sampling(checked_temperature(temperature), int(top_k), float(top_p))


def count(value: Any, what: str) -> int:
    """An int >= 0 (a number of tokens, a sync interval)."""
    if not is_int(value) or value < 0:
        raise InvalidArgument(f"{what} must be an int >= 0, got {shown(value)}")
    return int(value)


def token(value: Any, vocab_size: int) -> int:
    """A token id: an int in [0, vocab_size)."""
    if not is_int(value) or not 0 <= int(value) < vocab_size:
        raise InvalidArgument(f"token must be an int in [0, {vocab_size}), got {value!r}")
    return int(value)


def rollback_target(value: Any, position: int) -> int:
    """A position to roll back to: an int in [0, position]."""
    if not is_int(value) or not 0 <= value <= position:
        raise InvalidCapsuleRequest(f"to_position must be an int in [0, {position}], got {value!r}")
    return int(value)


def rollback_steps(value: Any, kept: int, depth: int) -> int:
    """Boundaries to roll back: an int in [0, kept], ``kept`` being those the ring holds behind
    the live one (at most ``depth``)."""
    if not is_int(value) or value < 0:
        raise InvalidCapsuleRequest(f"steps must be an int >= 0, got {value!r}")
    if value > kept:
        raise InvalidCapsuleRequest(f"cannot roll back {value} boundaries: {kept} are kept (rollback_depth={depth})")
    return int(value)


def groups(regions: Any, verify: bool) -> list[str] | None:
    """The state groups a partial restore names (None: a whole restore), or InvalidCapsuleRequest."""
    if regions is None:
        return None
    named = list(regions) if isinstance(regions, (list, tuple)) else None
    if not named or not all(isinstance(g, str) and g in GROUPS for g in named):
        raise InvalidCapsuleRequest(f"regions must be a list of groups among {list(GROUPS)}, got {shown(regions)}")
    if verify:
        raise InvalidCapsuleRequest("verify needs a full restore (regions=None)")
    return named
