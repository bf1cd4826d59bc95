"""The expert's demonstrations of the waypoint task, as sequences of any length a policy is cloned from.

Each demonstration is one route of one to three waypoints (a one-waypoint route is what an
urgent request is): the observations of its control periods from the first, each labelled with
the expert's targets, until ``TAIL_PERIODS`` after the expert arrives at the last waypoint.
- In a ``RESUME_SHARE`` of the routes of two or more waypoints, an urgent request interrupts
  the route off the record, at a period drawn as the ablation's are (``interruption_window``): the arm goes to another point and holds there, and the record
  goes on from that pose with the route as it was. That is the history a policy restored to
  the interruption finds on the resume. The urgent request is itself recorded, as a
  one-waypoint route that starts with the arm in motion.
- In a ``LEAD_IN_SHARE`` of the routes the arm is moving when the route is given (a few
  periods off the record), as an urgent request finds it.

The arm is driven by the expert's targets plus noise, every step labelled with the expert's own
targets (DART); or, given a policy (an engine), by the policy, the urgent request served in a
fresh context and the route resumed by restoring the snapshot taken at the interruption, as
``interruption`` runs them (DAgger).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .arm import Arm, ArmState
from .demonstrations import NOISE_RAD
from .interruption import URGENT_HOLD, URGENT_MAX_PERIODS, interruption_window
from .task import distance, expert, observe
from .waypoints import VISIT_RADIUS_M, Route, RouteExpert, route_observation, sample_point

ROUTE_LENGTHS = (1, 2, 3)
LENGTH_SHARES = (0.25, 0.25, 0.5)
RESUME_SHARE = 0.5
LEAD_IN_SHARE = 0.3
LEAD_IN_PERIODS = (1, 5)
TAIL_PERIODS = 10
MAX_PERIODS = 120   # a record's length at most: a policy that wanders is labelled this long


@dataclass(frozen=True)
class Sequences:
    """Demonstrations of any length: ``observations[i]`` [steps_i, OBS_DIM] and the expert's
    ``targets[i]`` [steps_i, ACTION_DIM], float32; ``targets[i][t]`` answers ``observations[i][t]``."""
    observations: tuple[np.ndarray, ...]
    targets: tuple[np.ndarray, ...]

    def __add__(self, other: "Sequences") -> "Sequences":
        return Sequences(self.observations + other.observations, self.targets + other.targets)

    def __len__(self) -> int:
        return len(self.observations)

    def padded(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``rows`` as one batch padded with zeros at the end to the longest: observations,
        targets and a mask (1 on real steps). A causal model's outputs on the real steps do
        not depend on the padding after them."""
        steps = max(len(self.observations[r]) for r in rows)
        obs = np.zeros((len(rows), steps, self.observations[0].shape[1]), dtype=np.float32)
        tgt = np.zeros((len(rows), steps, self.targets[0].shape[1]), dtype=np.float32)
        mask = np.zeros((len(rows), steps), dtype=np.float32)
        for i, r in enumerate(rows):
            n = len(self.observations[r])
            obs[i, :n], tgt[i, :n], mask[i, :n] = self.observations[r], self.targets[r], 1.0
        return obs, tgt, mask


class _Recorder:
    """Drives the arm a period at a time, by the policy or by the expert's label plus noise,
    and records each observation with its label."""

    def __init__(self, arm: Arm, policy: Any, rng: np.random.Generator) -> None:
        self.arm, self.policy, self.rng = arm, policy, rng
        self.observations: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []

    def period(self, state: ArmState, observation: np.ndarray, label: np.ndarray) -> ArmState:
        self.observations.append(observation)
        self.targets.append(label)
        if self.policy is not None:
            target = self.policy.step(observation).double().numpy()
        else:
            target = label + self.rng.normal(0.0, NOISE_RAD, size=label.shape)
        self.arm.command(np.clip(target, self.arm.lower, self.arm.upper))
        return self.arm.advance()

    def sequences(self) -> Sequences:
        return Sequences((np.asarray(self.observations, dtype=np.float32),),
                         (np.asarray(self.targets, dtype=np.float32),))


def demonstrate(seeds: range, arm: Arm | None = None, policy: Any = None) -> Sequences:
    """The demonstrations of ``seeds`` (see the module docstring); with a ``policy``, the
    policy drives and the expert labels every step (Ross et al., 2011, "DAgger")."""
    arm = arm or Arm()
    out: list[Sequences] = []
    for seed in seeds:
        rng = np.random.default_rng([seed, 2])   # a stream of its own: Route.sample draws from seed
        route = Route.sample(seed, int(rng.choice(ROUTE_LENGTHS, p=LENGTH_SHARES)))
        length = len(route.waypoints)
        interrupt_at = None
        if length > 1 and rng.random() < RESUME_SHARE:   # when the ablation's requests arrive
            first, last = interruption_window(route, arm)
            interrupt_at = int(rng.integers(first, last + 1))
        state = arm.reset(route.start)
        if rng.random() < LEAD_IN_SHARE:   # off the record: the route finds the arm moving
            state = _lead_in(arm, state, rng, route)
        if policy is not None:
            policy.reset()
        record, guide = _Recorder(arm, policy, rng), RouteExpert(route.waypoints)
        tail = 0
        for period in range(MAX_PERIODS):
            if period == interrupt_at:
                state, urgent = _urgent(arm, state, rng, route, policy)
                out.append(urgent)
                guide.resume()
            label = guide.label(state)
            state = record.period(state, route_observation(state, route.waypoints, period), label)
            tail += guide.done
            if tail > TAIL_PERIODS:
                break
        out.append(record.sequences())
    return Sequences(tuple(a for s in out for a in s.observations), tuple(a for s in out for a in s.targets))


def _lead_in(arm: Arm, state: ArmState, rng: np.random.Generator, route: Route) -> ArmState:
    toward = sample_point(rng, route.waypoints)
    for _ in range(int(rng.integers(LEAD_IN_PERIODS[0], LEAD_IN_PERIODS[1] + 1))):
        target = expert(state, toward) + rng.normal(0.0, NOISE_RAD, size=3)
        arm.command(np.clip(target, arm.lower, arm.upper))
        state = arm.advance()
    return state


def _urgent(arm: Arm, state: ArmState, rng: np.random.Generator, route: Route,
            policy: Any) -> tuple[ArmState, Sequences]:
    """The urgent request, off the route's record and recorded as a route of its own; a policy
    serves it in a fresh context and is restored to the interruption after it."""
    point = sample_point(rng, route.waypoints)
    hold = int(rng.integers(URGENT_HOLD[0], URGENT_HOLD[1] + 1))
    capsule = None
    if policy is not None:
        capsule = policy.snapshot(name="interrupted")
        policy.reset()
    record, guide, arrived = _Recorder(arm, policy, rng), RouteExpert([point]), None
    try:
        for period in range(URGENT_MAX_PERIODS):
            state = record.period(state, observe(state, point if period == 0 else None), guide.label(state))
            if arrived is None and distance(state, point) < VISIT_RADIUS_M:
                arrived = period
            if arrived is not None and period - arrived >= hold:
                break
        if capsule is not None:
            policy.restore(capsule.id)
    finally:
        if capsule is not None:
            policy.capsules.drop(capsule.id)
    return state, record.sequences()
