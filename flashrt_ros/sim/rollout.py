"""A policy engine driving the simulated arm in a closed loop, in this process (no ROS): held-out
success of a trained policy, and the retry ablation, where the state a retry starts from is
what differs.

An episode: the goal step, then an attempt with the shoulder jammed from ``JAM_STEP`` on (it
fails), then the jam is freed and the retry starts from the arm's present pose, with the policy
state one of:
  full      the snapshot taken after the goal step, restored whole
  kv        the same snapshot, restored for its KV regions only (the recurrent, conv and other
            state as the failed attempt left them)
  reset     a fresh state that never saw the goal
  continue  no rollback: the state the failed attempt left
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .arm import Arm, ArmState
from .task import ATTEMPT_STEPS, SUCCESS_RADIUS_M, Episode, distance, observe

JAM_STEP = 2
RETRIES = ("full", "kv", "reset", "continue")


@dataclass
class Attempt:
    """The end effector's path (x, y per control period) and whether it reached the goal."""
    path: list[tuple[float, float]] = field(default_factory=list)
    success: bool = False


def act(engine: Any, arm: Arm, state: ArmState, goal: np.ndarray | None) -> ArmState:
    """One control period: the policy's targets for ``state`` (``goal`` on the goal step) to the arm."""
    action = engine.step(observe(state, goal)).double().numpy()
    arm.command(np.clip(action, arm.lower, arm.upper))
    return arm.advance()


def attempt(engine: Any, arm: Arm, state: ArmState, goal: np.ndarray, jam: bool = False) -> tuple[ArmState, Attempt]:
    """``ATTEMPT_STEPS`` control periods; success when the end effector ends within the radius."""
    out = Attempt([tuple(state.ee_position[:2])])
    for t in range(ATTEMPT_STEPS):
        if jam and t == JAM_STEP:
            arm.block(0)
        state = act(engine, arm, state, None)
        out.path.append(tuple(state.ee_position[:2]))
    out.success = distance(state, goal) < SUCCESS_RADIUS_M
    return state, out


def reach(engine: Any, arm: Arm, episode: Episode) -> Attempt:
    """An undisturbed episode from a fresh state: the goal step, then one attempt."""
    engine.reset()
    state = act(engine, arm, arm.reset(episode.start), episode.goal)
    return attempt(engine, arm, state, episode.goal)[1]


def with_retry(engine: Any, arm: Arm, episode: Episode, retry: str) -> tuple[Attempt, Attempt]:
    """The jammed attempt and the retry from ``retry``'s state (see the module docstring)."""
    if retry not in RETRIES:
        raise ValueError(f"retry must be one of {RETRIES}, got {retry!r}")
    engine.reset()
    state = act(engine, arm, arm.reset(episode.start), episode.goal)
    snapshot = engine.snapshot(name="goal-taken-in")
    try:
        state, first = attempt(engine, arm, state, episode.goal, jam=True)
        arm.unblock()
        if retry == "full":
            engine.restore(snapshot.id)
        elif retry == "kv":
            engine.restore(snapshot.id, regions=["kv"])
        elif retry == "reset":
            engine.reset()
        _, second = attempt(engine, arm, state, episode.goal)
    finally:
        engine.capsules.drop(snapshot.id)
    return first, second
