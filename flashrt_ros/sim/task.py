"""The reaching task: the goal is shown once, on the first step of an episode, and never again.

A goal is a point in the arm's plane, at least ``MIN_TURN`` from where the arm points at the
start: with the shoulder jammed (the disturbance) it lies out of reach of the other two links,
so the attempt fails. The scripted expert has the goal always (privileged access); a policy has
it only in its state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..serving.observation import GOAL_SIZE, observation_of, observation_size, with_goal
from .arm import JOINT_NAMES, ArmState

OBS_DIM = observation_size(len(JOINT_NAMES)) + GOAL_SIZE
ACTION_DIM = len(JOINT_NAMES)
SUCCESS_RADIUS_M = 0.03
ATTEMPT_STEPS = 40            # control periods an attempt may take (2 s at 20 Hz)
MIN_TURN = math.radians(100)  # goal bearing from the arm's starting direction, at least
MAX_STEP_RAD = 0.25           # the expert's largest target change per control period
LINKS = (0.30, 0.25, 0.20)    # link lengths of data/sim/reach_arm.xml
JOINT_LIMIT = 2.6             # and its joints' range, +-


@dataclass(frozen=True)
class Episode:
    """A seeded episode: where the arm starts, and the goal."""
    seed: int
    start: np.ndarray
    goal: np.ndarray

    @classmethod
    def sample(cls, seed: int) -> "Episode":
        rng = np.random.default_rng(seed)
        while True:
            start = np.concatenate([rng.uniform(-0.8, 0.8, size=1), rng.uniform(-1.2, 1.2, size=ACTION_DIM - 1)])
            heading = start[0] + rng.choice([-1, 1]) * rng.uniform(MIN_TURN, math.pi)
            radius = rng.uniform(0.35, 0.62)
            goal = np.array([radius * math.cos(heading), radius * math.sin(heading), 0.0])
            if np.abs(reach_pose(goal)).max() <= JOINT_LIMIT - 0.2:   # reachable inside the joints' range
                return cls(seed, start, goal)


def observe(state: ArmState, goal: np.ndarray | None) -> np.ndarray:
    """The policy's observation: the arm's state, and the goal block (``goal`` on the first step)."""
    return with_goal(observation_of(state.position, state.velocity, state.ee_position, state.ee_quaternion), goal)


def distance(state: ArmState, goal: np.ndarray) -> float:
    return float(np.linalg.norm(state.ee_position[:2] - goal[:2]))


def reach_pose(goal: np.ndarray, links: tuple[float, float, float] = LINKS) -> np.ndarray:
    """Joint positions that put the end effector on ``goal``, pointing away from the base,
    elbow bent one way: one smooth pose per goal, which a policy can learn."""
    l1, l2, l3 = links
    heading = math.atan2(goal[1], goal[0])
    wx, wy = goal[0] - l3 * math.cos(heading), goal[1] - l3 * math.sin(heading)
    cos_elbow = np.clip((wx * wx + wy * wy - l1 * l1 - l2 * l2) / (2 * l1 * l2), -1.0, 1.0)
    elbow = math.acos(cos_elbow)
    shoulder = math.atan2(wy, wx) - math.atan2(l2 * math.sin(elbow), l1 + l2 * math.cos(elbow))
    return np.array([shoulder, elbow, heading - shoulder - elbow])


def expert(state: ArmState, goal: np.ndarray) -> np.ndarray:
    """Joint targets one control period ahead: toward the goal's reach pose, each change
    clipped to ``MAX_STEP_RAD``."""
    step = reach_pose(goal) - state.position
    largest = np.abs(step).max()
    if largest > MAX_STEP_RAD:
        step *= MAX_STEP_RAD / largest
    return np.clip(state.position + step, -JOINT_LIMIT, JOINT_LIMIT)
