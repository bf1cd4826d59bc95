"""One policy observation from a JointState and an end-effector PoseStamped.

Layout: joint positions, joint velocities (by name, in the configured order),
end-effector position (3), then its rotation as the first two columns of the
rotation matrix (6). The two columns are used instead of Euler angles or a
quaternion because they are continuous over all rotations (no wrap-around at
+-pi, no q/-q ambiguity), which is what a learned head wants as input.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import numpy as np
from transforms3d.quaternions import quat2mat

from ..errors import InvalidArgument


def observation_size(joints: int) -> int:
    return 2 * joints + 9


def stamp_gap(joint_state, pose_stamped) -> float | None:
    """Seconds between the two messages' header stamps; None when either is unstamped (zero),
    as publishers that do not keep time leave them."""
    j, p = joint_state.header.stamp, pose_stamped.header.stamp
    if not (j.sec or j.nanosec) or not (p.sec or p.nanosec):
        return None
    return abs((j.sec - p.sec) + (j.nanosec - p.nanosec) * 1e-9)


def paired(joint_names: Sequence[str], joint_state, pose_stamped, max_pose_age: float) -> np.ndarray:
    """The observation of a joint state and the latest pose before it, as the node pairs them:
    InvalidArgument, with the reason, when there is no pose yet, when their stamps lie more
    than ``max_pose_age`` seconds apart (> 0: a pose publisher that stopped would otherwise
    pair every new joint state with where the arm was then), or when a message does not fit."""
    if pose_stamped is None:
        raise InvalidArgument("no ~/ee_pose received yet; an observation needs both joint states and the pose")
    gap = stamp_gap(joint_state, pose_stamped)
    if max_pose_age > 0 and gap is not None and gap > max_pose_age:
        raise InvalidArgument(f"~/ee_pose and ~/joint_states are {gap:.3f} s apart by their stamps "
                              f"(policy.max_pose_age {max_pose_age:g} s)")
    return build_observation(joint_names, joint_state, pose_stamped)


def build_observation(joint_names: Sequence[str], joint_state, pose_stamped) -> np.ndarray:
    """float32 vector of ``observation_size(len(joint_names))``; InvalidArgument if a message does not fit."""
    counts = Counter(joint_state.name)
    twice = [n for n in joint_names if counts[n] > 1]
    if twice:   # which of the two readings would be the joint's? (Others the policy never reads.)
        raise InvalidArgument(f"joint_states names joints more than once: {twice[:5]}")
    index = {name: i for i, name in enumerate(joint_state.name)}
    missing = [n for n in joint_names if n not in index]
    if missing:
        raise InvalidArgument(f"joint_states lacks joints {missing[:5]} (has {list(joint_state.name)[:10]})")
    if len(joint_state.position) != len(joint_state.name):
        raise InvalidArgument(f"joint_states has {len(joint_state.name)} names but "
                              f"{len(joint_state.position)} positions")
    if len(joint_state.velocity) and len(joint_state.velocity) != len(joint_state.name):
        raise InvalidArgument(f"joint_states has {len(joint_state.name)} names but "
                              f"{len(joint_state.velocity)} velocities")
    rows = [index[n] for n in joint_names]
    position = np.asarray(joint_state.position, dtype=np.float64)[rows]
    # JointState may leave velocity empty (not measured); zero is then the neutral input.
    velocity = (np.asarray(joint_state.velocity, dtype=np.float64)[rows] if len(joint_state.velocity)
                else np.zeros(len(rows)))
    p, q = pose_stamped.pose.position, pose_stamped.pose.orientation
    return observation_of(position, velocity, (p.x, p.y, p.z), (q.w, q.x, q.y, q.z))


def observation_of(position: Sequence[float], velocity: Sequence[float], ee_position: Sequence[float],
                   ee_quaternion: Sequence[float]) -> np.ndarray:
    """The same from arrays: joint positions and velocities in the policy's order, the end
    effector's position and its (w, x, y, z) orientation."""
    w, x, y, z = (float(v) for v in ee_quaternion)
    norm = math.sqrt(w * w + x * x + y * y + z * z)
    if not math.isfinite(norm) or norm < 1e-6:
        raise InvalidArgument(f"ee_pose orientation is not a rotation (quaternion norm {norm})")
    rotation = quat2mat([w / norm, x / norm, y / norm, z / norm])
    obs = np.concatenate([np.asarray(position, dtype=np.float64), np.asarray(velocity, dtype=np.float64),
                          np.asarray(ee_position, dtype=np.float64), rotation[:, 0], rotation[:, 1]])
    if not np.isfinite(obs).all():
        raise InvalidArgument("observation contains NaN or infinity")
    return obs.astype(np.float32)


GOAL_SIZE = 4   # x, y, z of the goal position, then 1 on the step that takes it in (else all 0)


def with_goal(observation: np.ndarray, goal: Sequence[float] | None) -> np.ndarray:
    """``observation`` followed by the goal block: the goal on the one step it is given, zeros
    on every other, so that a policy must keep it in its state."""
    block = np.zeros(GOAL_SIZE, dtype=np.float32) if goal is None else \
        np.array([*goal, 1.0], dtype=np.float64).astype(np.float32)
    if block.shape != (GOAL_SIZE,) or not np.isfinite(block).all():
        raise InvalidArgument(f"a goal is a finite (x, y, z), got {goal!r}")
    return np.concatenate([observation, block])
