"""The waypoint task: a route of waypoints, given once at the start, visited in order.

A route is ``ROUTE_LENGTH`` points in the arm's plane (A, B, C). They are given one per control
period on the first periods of an episode, each in the observation's goal block (the point and
a 1), as a behaviour tree publishes a route on a goal topic; after that the goal block is zeros.
The arm visits a waypoint when its end effector comes within ``VISIT_RADIUS_M`` of it, and only
the next waypoint of the route counts: passing C on the way to B visits nothing. The route is
done when every waypoint is visited in order within ``PERIODS_PER_WAYPOINT`` control periods per
waypoint.

What the policy must hold in its state is the route and how far along it is: the waypoints are
never shown again, and which one comes next is nowhere in the observation.

The scripted expert has the route always (privileged access): it steers toward the reach pose
of the next waypoint, pauses briefly at each it visits (``RouteExpert``), and holds at the last.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .arm import ArmState
from .task import ACTION_DIM, JOINT_LIMIT, LINKS, SUCCESS_RADIUS_M, distance, expert, observe, reach_pose

ROUTE_LENGTH = 3
VISIT_RADIUS_M = SUCCESS_RADIUS_M   # the reaching task's success radius
DWELL_PERIODS = 5                   # the expert stays at a waypoint this long after its visit
PERIODS_PER_WAYPOINT = 30           # the time budget: 1.5 s per waypoint at 20 Hz
MIN_SEPARATION_M = 0.2              # between any two points of an episode, and from where the arm starts
REACH_RADII_M = (0.35, 0.62)        # the band of distances from the base that waypoints lie in


def sample_point(rng: np.random.Generator, away_from: Sequence[np.ndarray] = ()) -> np.ndarray:
    """A point of the plane the arm reaches inside its joints' range, at least
    ``MIN_SEPARATION_M`` from each of ``away_from``."""
    while True:
        heading = rng.uniform(-math.pi, math.pi)
        radius = rng.uniform(*REACH_RADII_M)
        point = np.array([radius * math.cos(heading), radius * math.sin(heading), 0.0])
        if np.abs(reach_pose(point)).max() > JOINT_LIMIT - 0.2:
            continue
        if all(np.linalg.norm(point[:2] - other[:2]) >= MIN_SEPARATION_M for other in away_from):
            return point


def sample_start(rng: np.random.Generator) -> np.ndarray:
    """Joint positions the arm starts at (the reaching task's range)."""
    return np.concatenate([rng.uniform(-0.8, 0.8, size=1), rng.uniform(-1.2, 1.2, size=ACTION_DIM - 1)])


def end_effector(position: np.ndarray) -> np.ndarray:
    """Where the end effector is at joint ``position`` (planar forward kinematics)."""
    angles = np.cumsum(position)
    return np.array([sum(l * math.cos(a) for l, a in zip(LINKS, angles)),
                     sum(l * math.sin(a) for l, a in zip(LINKS, angles)), 0.0])


@dataclass(frozen=True)
class Route:
    """A seeded episode of the task: where the arm starts, and the waypoints in order."""
    seed: int
    start: np.ndarray
    waypoints: tuple[np.ndarray, ...]

    @classmethod
    def sample(cls, seed: int, length: int = ROUTE_LENGTH) -> "Route":
        if length < 1:
            raise ValueError(f"a route has at least one waypoint, got length {length}")
        rng = np.random.default_rng(seed)
        start = sample_start(rng)
        points: list[np.ndarray] = [end_effector(start)]
        for _ in range(length):
            points.append(sample_point(rng, points))
        return cls(seed, start, tuple(points[1:]))

    @property
    def budget(self) -> int:
        """Control periods the whole route may take."""
        return PERIODS_PER_WAYPOINT * len(self.waypoints)


def route_observation(state: ArmState, waypoints: Sequence[np.ndarray], period: int) -> np.ndarray:
    """The observation of control period ``period`` (0 first) of a route: waypoint ``period`` in
    the goal block while the route is being given, zeros after."""
    return observe(state, waypoints[period] if period < len(waypoints) else None)


class Progress:
    """The judge: which waypoints the arm has visited, in order."""

    def __init__(self, waypoints: Sequence[np.ndarray]) -> None:
        self.waypoints = tuple(waypoints)
        self.visited = 0

    @property
    def done(self) -> bool:
        return self.visited == len(self.waypoints)

    @property
    def remaining(self) -> tuple[np.ndarray, ...]:
        return self.waypoints[self.visited:]

    def update(self, state: ArmState) -> bool:
        """Take in the arm's state after a control period; True when it visits the next waypoint."""
        if not self.done and distance(state, self.waypoints[self.visited]) < VISIT_RADIUS_M:
            self.visited += 1
            return True
        return False


class RouteExpert:
    """The scripted expert of a route: joint targets one control period ahead, toward the first
    waypoint not yet visited (as ``Progress`` judges it, on each state it answers); after a
    visit it stays at that waypoint ``DWELL_PERIODS`` more, then heads for the next; it holds at
    the last.

    The pause puts the move to the next waypoint where a policy can tell it comes: a count of
    periods from the visit, about when the arm comes to rest. Moving on at the visit itself
    would put it where the end effector crosses a radius, which a policy that holds the
    waypoint to a centimetre cannot place, and it learns to stop short there instead."""

    def __init__(self, waypoints: Sequence[np.ndarray]) -> None:
        self.progress = Progress(waypoints)
        self.dwelling = 0   # periods left at the waypoint just visited

    @property
    def done(self) -> bool:
        return self.progress.done

    def resume(self) -> None:
        """After an interruption: the pause at the waypoint last visited is over."""
        self.dwelling = 0

    def label(self, state: ArmState) -> np.ndarray:
        """The targets that answer ``state``."""
        if self.progress.update(state):
            self.dwelling = DWELL_PERIODS
        waypoints, visited = self.progress.waypoints, self.progress.visited
        if self.dwelling:
            self.dwelling -= 1
            return expert(state, waypoints[visited - 1])
        return expert(state, waypoints[min(visited, len(waypoints) - 1)])
