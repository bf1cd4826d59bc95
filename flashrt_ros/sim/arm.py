"""The planar three-joint arm of data/sim/reach_arm.xml, stepped one control period at a time.

Deterministic: MuJoCo's step is a pure function of the model and the state, and the state is
only ever set by ``reset`` and ``command``. Commands are joint position targets, checked
before they are taken (``check_command``): a refused command leaves the targets as they were.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mujoco
import numpy as np

from ..errors import InvalidArgument
from ..resources import package_file

JOINT_NAMES = ("joint1", "joint2", "joint3")
CONTROL_PERIOD_S = 0.05


def model_path() -> Path:
    return package_file("data/sim/reach_arm.xml")


@dataclass(frozen=True)
class ArmState:
    """What the arm's sensors report: joint positions and velocities, the end effector's
    position and orientation (a w, x, y, z quaternion), at ``time`` seconds of simulation."""
    time: float
    position: np.ndarray
    velocity: np.ndarray
    ee_position: np.ndarray
    ee_quaternion: np.ndarray


class Arm:
    def __init__(self, control_period_s: float = CONTROL_PERIOD_S) -> None:
        self.model = mujoco.MjModel.from_xml_path(str(model_path()))
        self.data = mujoco.MjData(self.model)
        substeps = control_period_s / self.model.opt.timestep
        if substeps < 1 or abs(substeps - round(substeps)) > 1e-9:
            raise InvalidArgument(f"control period {control_period_s} s is not a whole number of "
                                  f"{self.model.opt.timestep} s physics steps")
        self.substeps = round(substeps)
        self.period = control_period_s
        self._ee = self.model.site("ee").id
        self.lower, self.upper = self.model.jnt_range[:, 0].copy(), self.model.jnt_range[:, 1].copy()
        self.blocked: set[int] = set()

    def reset(self, position: Sequence[float]) -> ArmState:
        """At rest at ``position``, time 0, targets there too, nothing blocked."""
        mujoco.mj_resetData(self.model, self.data)
        self.data.qpos[:] = np.clip(np.asarray(position, dtype=np.float64), self.lower, self.upper)
        self.data.ctrl[:] = self.data.qpos
        self.blocked.clear()
        self.data.eq_active[:] = 0
        mujoco.mj_forward(self.model, self.data)
        return self.state()

    def check_command(self, names: Sequence[str], positions: Sequence[float]) -> np.ndarray:
        """The targets in joint order; InvalidArgument naming what is wrong."""
        names = list(names)
        if sorted(names) != sorted(JOINT_NAMES) or len(set(names)) != len(names):
            raise InvalidArgument(f"a command names joints {names}, the arm has {list(JOINT_NAMES)}")
        if len(positions) != len(names):
            raise InvalidArgument(f"a command has {len(names)} joint names and {len(positions)} positions")
        values = np.asarray(positions, dtype=np.float64)
        if not np.isfinite(values).all():
            raise InvalidArgument("a command holds NaN or infinity")
        target = values[[names.index(n) for n in JOINT_NAMES]]
        outside = (target < self.lower) | (target > self.upper)
        if outside.any():
            j = int(np.flatnonzero(outside)[0])
            raise InvalidArgument(f"{JOINT_NAMES[j]} target {target[j]:.3f} rad is outside "
                                  f"[{self.lower[j]:.2f}, {self.upper[j]:.2f}]")
        return target

    def command(self, target: np.ndarray) -> None:
        self.data.ctrl[:] = target

    def block(self, joint: int) -> None:
        """Hold ``joint`` where it is now (a jammed joint), until ``unblock``."""
        self.model.eq_data[joint, 0] = self.data.qpos[joint] - self.model.qpos0[joint]
        self.data.eq_active[joint] = 1
        self.blocked.add(joint)

    def unblock(self) -> None:
        self.data.eq_active[:] = 0
        self.blocked.clear()

    def advance(self) -> ArmState:
        """One control period of physics."""
        mujoco.mj_step(self.model, self.data, nstep=self.substeps)
        return self.state()

    def state(self) -> ArmState:
        quat = np.empty(4)
        mujoco.mju_mat2Quat(quat, self.data.site_xmat[self._ee])
        return ArmState(float(self.data.time), self.data.qpos.copy(), self.data.qvel.copy(),
                        self.data.site_xpos[self._ee].copy(), quat)


def wrap(angle: float) -> float:
    return (angle + math.pi) % (2 * math.pi) - math.pi
