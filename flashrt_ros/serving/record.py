"""What a journal says about the engine its entries ran on, and how a node served it.

One frozen value, made by ``replay.session.session_of`` (and by the node, which adds how it
serves), carried by the journal, written to bags as ``msg/JournalSession`` and read back. A
field a record made before it existed reads as its default here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The journal bag's format: raised whenever JournalEntry or JournalSession changes its fields,
# so that a bag of another format is refused by name, not misread.
VERSION = 2


@dataclass(frozen=True)
class SessionRecord:
    """Replay rebuilds an engine from the first group of fields, and promises the exact
    verdict only on the platform of the second (see ``replay.session``)."""

    # The engine.
    model_fingerprint: str = ""
    layout_fingerprint: str = ""
    version: int = VERSION
    model_path: str = ""   # empty: the embedded default
    seed: int = 0
    dtype: str = "float32"
    max_seq_len: int = 0
    prefill_chunk: int = 512
    obs_dim: int = 0
    action_dim: int = 0
    rollback_depth: int = 0
    budgets: tuple[tuple[str, int], ...] = ()   # (tier, bytes)
    spill: bool = True
    disk_tier: bool = False
    signed: bool = False   # capsule files were signed with a key (which is not recorded)
    capsule_dir: str = ""
    preloaded: tuple[tuple[str, str], ...] = ()   # (id, digest) of the disk capsules found at start
    # The platform: what decides how the engine's products round.
    device: str = "cpu"
    torch: str = ""
    torch_threads: int = 0
    aten_cpu_capability: str = ""
    cpu: str = ""
    cuda_graphs: bool = True
    fixed_shapes: bool = False
    cpu_kernels: bool = False
    kernels: tuple[tuple[str, str], ...] = ()   # (kernel, version) of the CPU backend's C kernels
    # How a node served it (empty: recorded in process): what replay of a bag of the node's
    # topics and service events needs and cannot find in the bag.
    node: str = ""
    default_tier: str = ""
    joint_names: tuple[str, ...] = ()
    joint_states_topic: str = ""
    ee_pose_topic: str = ""
    action_topic: str = ""
    max_pose_age: float = 0.0

    @property
    def budget_bytes(self) -> dict[str, int]:
        return dict(self.budgets)

    def platform(self, kernel_names: tuple[str, ...]) -> dict[str, Any]:
        """The platform fields by name, with the version of each of ``kernel_names`` ("" when not run)."""
        kernels = dict(self.kernels)
        here: dict[str, Any] = {"device": self.device, "torch": self.torch,
                                "aten_cpu_capability": self.aten_cpu_capability, "cpu": self.cpu,
                                "torch_threads": self.torch_threads, "cpu_kernels": self.cpu_kernels}
        here.update({name: kernels.get(name, "") for name in kernel_names})
        return here
