"""The model runtime: config, weights, state arena, hybrid model and engine. No ROS imports."""
from ..errors import CheckpointError, ErrorCode, FlashRTError, InvalidArgument
from .arena import Region, RegionSpec, StateArena
from .config import ModelConfig
from .engine import Engine
from .sampling import GREEDY, Sampling

__all__ = ["CheckpointError", "Engine", "ErrorCode", "FlashRTError", "GREEDY", "InvalidArgument", "ModelConfig",
           "Region", "RegionSpec", "Sampling", "StateArena"]
