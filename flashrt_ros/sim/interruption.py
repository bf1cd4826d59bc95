"""An operator's urgent request in the middle of a route, and the resume, in this process (no ROS).

An episode: the policy runs the route (``waypoints``) for ``period`` control periods; the tree
snapshots the policy there; the urgent request (go to ``point`` and hold there ``hold``
periods) is served by the same policy in a fresh context, as the policy node serves every goal
(it starts an episode from its episode-start capsule), so it writes the whole state, recurrent
and attention alike; then the route resumes from the arm's pose at the urgent point, with the
policy's state recovered in one of these ways (``RESUMES``):
  full       restore the capsule taken at the interruption
  kv         restore its KV rows and position only (``regions=["kv"]``); the recurrent and conv
             state as the urgent request left them
  not_kv     restore every other group (recurrent, conv, meta with the position); the KV rows
             below the position as the urgent request left them, which it overwrote from row 0
  none       no restore: the state the urgent request left
  recompute  reset, then feed the observations recorded up to the interruption again, one
             step each (what a server without recurrent snapshots must do)
  regive     reset, and give the waypoints not yet visited again, one per period as at the start
             (progress held in the state is lost; the tree must have judged the visits itself)

The resume succeeds when the waypoints left at the interruption are all visited, in order,
within ``PERIODS_PER_WAYPOINT`` control periods each. The same protocol serves the ablation
(``resume_ablation``) and the tests.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .arm import Arm, ArmState
from .task import distance, observe, reach_pose
from .waypoints import (PERIODS_PER_WAYPOINT, VISIT_RADIUS_M, Progress, Route, RouteExpert, route_observation,
                        sample_point)

RESUMES = ("full", "kv", "not_kv", "none", "recompute", "regive")
URGENT_HOLD = (10, 30)        # periods the arm holds at the urgent point once there, drawn per episode
URGENT_MAX_PERIODS = 60       # the tree gives up on the urgent request after this many periods
HEADING_RAD = 0.02            # joint-space motion per period that counts as heading for a waypoint: at least
HEADING_DEG = 30.0            # ... this much, within this angle of the straight line to its reach pose,
HEADING_PERIODS = 3           # ... in this many periods in a row


@dataclass(frozen=True)
class Interrupted:
    """A seeded interrupted episode: the route, the control period the urgent request arrives
    at (the route has run that many), the urgent point and how long the arm holds there."""
    route: Route
    period: int
    point: np.ndarray
    hold: int

    @classmethod
    def sample(cls, seed: int, arm: Arm | None = None) -> "Interrupted":
        """The request arrives at a period drawn uniformly while the route is under way: after
        it is given, and before the scripted expert, run without interruption, visits the last
        waypoint (so that a route is left to resume). The point lies away from every waypoint."""
        route = Route.sample(seed)
        rng = np.random.default_rng([seed, 1])   # a stream of its own: Route.sample draws from seed
        first, last = interruption_window(route, arm or Arm())
        period = int(rng.integers(first, last + 1))
        point = sample_point(rng, route.waypoints)
        hold = int(rng.integers(URGENT_HOLD[0], URGENT_HOLD[1] + 1))
        return cls(route, period, point, hold)


def interruption_window(route: Route, arm: Arm) -> tuple[int, int]:
    """The first and last control period an urgent request may arrive at, both included: once
    the route is given (two periods after its last waypoint), and three periods before the
    scripted expert, uninterrupted, visits the last waypoint."""
    first = len(route.waypoints) + 2
    return first, max(first, expert_finish(route, arm) - 3)


def expert_finish(route: Route, arm: Arm) -> int:
    """The control period at which the scripted expert, uninterrupted, visits the last waypoint."""
    state, guide, progress = arm.reset(route.start), RouteExpert(route.waypoints), Progress(route.waypoints)
    for period in range(1, route.budget + 1):
        arm.command(guide.label(state))
        state = arm.advance()
        progress.update(state)
        if progress.done:
            return period
    raise RuntimeError(f"the expert does not finish route {route.seed} within {route.budget} periods")


def act(engine: Any, arm: Arm, observation: np.ndarray) -> ArmState:
    """One control period: the policy's targets for ``observation``, clipped to the joints' range, to the arm."""
    action = engine.step(observation).double().numpy()
    arm.command(np.clip(action, arm.lower, arm.upper))
    return arm.advance()


@dataclass
class RouteRun:
    """An uninterrupted route: the end effector's path (x, y per period) and whether it was done in time."""
    path: list[tuple[float, float]] = field(default_factory=list)
    visited: int = 0
    success: bool = False


def run_route(engine: Any, arm: Arm, route: Route) -> RouteRun:
    """The route from a fresh state, without interruption."""
    engine.reset()
    state, progress = arm.reset(route.start), Progress(route.waypoints)
    out = RouteRun([tuple(state.ee_position[:2])])
    for period in range(route.budget):
        state = act(engine, arm, route_observation(state, route.waypoints, period))
        out.path.append(tuple(state.ee_position[:2]))
        progress.update(state)
        if progress.done:
            break
    out.visited, out.success = progress.visited, progress.done
    return out


@dataclass
class Resumed:
    """One interrupted episode resumed one way."""
    resume: str
    remaining: int                 # waypoints left at the interruption
    history: int                   # observations in the state at the interruption (its position)
    urgent_periods: int            # control periods the urgent request took
    recovery_s: float              # wall time of the state's recovery (restore, or history fed again)
    heading: int | None            # control periods after the resume until the arm heads for the right waypoint
    success: bool
    digest_at_interruption: str
    digest_recovered: str          # the state's digest right after the recovery
    paths: dict[str, list[tuple[float, float]]] = field(default_factory=dict)   # before, urgent, after


def serve_urgent(engine: Any, arm: Arm, state: ArmState, point: np.ndarray, hold: int,
                 path: list[tuple[float, float]]) -> tuple[ArmState, int]:
    """The urgent request in a fresh context: the point on the first period, then until the end
    effector has been there (within the visit radius) ``hold`` periods since it first came, or
    the tree's limit. Returns the arm's state and the periods it took."""
    engine.reset()
    arrived = None
    for period in range(URGENT_MAX_PERIODS):
        state = act(engine, arm, observe(state, point if period == 0 else None))
        path.append(tuple(state.ee_position[:2]))
        if arrived is None and distance(state, point) < VISIT_RADIUS_M:
            arrived = period
        if arrived is not None and period - arrived >= hold:
            return state, period + 1
    return state, URGENT_MAX_PERIODS


def recover(engine: Any, resume: str, capsule: str, history: Sequence[np.ndarray]) -> float:
    """The policy state's recovery for ``resume``; its wall time in seconds. ``capsule`` is the
    snapshot taken at the interruption, ``history`` the observations fed up to it."""
    started = time.perf_counter()
    if resume == "full":
        engine.restore(capsule)
    elif resume == "kv":
        engine.restore(capsule, regions=["kv"])
    elif resume == "not_kv":
        engine.restore(capsule, regions=state_groups(engine, but="kv"))
    elif resume == "recompute":
        engine.reset()
        for observation in history:
            engine.step(observation)
    elif resume == "regive":
        engine.reset()
    elif resume != "none":
        raise ValueError(f"resume must be one of {RESUMES}, got {resume!r}")
    return time.perf_counter() - started


def state_groups(engine: Any, but: str) -> list[str]:
    """The state groups the engine's arena holds, less ``but``, in the region table's order."""
    groups = dict.fromkeys(region["group"] for region in engine.region_table)
    return [g for g in groups if g != but]


def heading(positions: Sequence[np.ndarray], waypoint: np.ndarray, visited_at: int | None) -> int | None:
    """Control periods after the resume until the arm heads for ``waypoint``: the first period t
    (1 is the first after the resume) that starts ``HEADING_PERIODS`` periods in a row in each
    of which the joints move at least ``HEADING_RAD`` (Euclidean, in joint space) within
    ``HEADING_DEG`` of the straight line to the waypoint's reach pose, the pose the expert steers
    to; a period at or after the waypoint is visited counts as heading there. ``positions[0]``
    is the joints at the resume; None if never."""
    pose = reach_pose(waypoint)
    towards = []
    for t in range(1, len(positions)):
        moved, wanted = positions[t] - positions[t - 1], pose - positions[t - 1]
        size = float(np.linalg.norm(moved))
        aligned = size >= HEADING_RAD and float(moved @ wanted) >= math.cos(math.radians(HEADING_DEG)) * size * \
            float(np.linalg.norm(wanted))
        towards.append(aligned or (visited_at is not None and t >= visited_at))
    if visited_at is not None:   # the run stops once the route is done; a visit has headed there
        towards += [True] * HEADING_PERIODS
    for t in range(len(towards) - HEADING_PERIODS + 1):
        if all(towards[t:t + HEADING_PERIODS]):
            return t + 1
    return None


def run_interrupted(engine: Any, arm: Arm, episode: Interrupted, resume: str) -> Resumed:
    """The episode: the route until the interruption, a snapshot, the urgent request, the
    recovery for ``resume``, then the rest of the route."""
    if resume not in RESUMES:
        raise ValueError(f"resume must be one of {RESUMES}, got {resume!r}")
    route = episode.route
    engine.reset()
    state, progress = arm.reset(route.start), Progress(route.waypoints)
    paths: dict[str, list[tuple[float, float]]] = {"before": [tuple(state.ee_position[:2])]}
    history = []
    for period in range(episode.period):
        # Judged as the policy sees them: the state the interruption finds is not one it saw,
        # so a visit there would be one it cannot know of.
        progress.update(state)
        history.append(route_observation(state, route.waypoints, period))
        state = act(engine, arm, history[-1])
        paths["before"].append(tuple(state.ee_position[:2]))
    capsule = engine.snapshot(name="interrupted")
    try:
        at_interruption = engine.state_digest()
        remaining = progress.remaining
        paths["urgent"] = [paths["before"][-1]]
        state, urgent_periods = serve_urgent(engine, arm, state, episode.point, episode.hold, paths["urgent"])
        recovery_s = recover(engine, resume, capsule.id, history)
        recovered = engine.state_digest()
    finally:
        engine.capsules.drop(capsule.id)
    given = remaining if resume == "regive" else ()
    positions, visited_at = [state.position], None
    paths["after"] = [tuple(state.ee_position[:2])]
    for period in range(PERIODS_PER_WAYPOINT * len(remaining)):
        if progress.done:
            break
        state = act(engine, arm, route_observation(state, given, period))
        positions.append(state.position)
        paths["after"].append(tuple(state.ee_position[:2]))
        if progress.update(state) and visited_at is None:
            visited_at = period + 1
    to_head = heading(positions, remaining[0], visited_at) if remaining else 0
    return Resumed(resume, len(remaining), len(history), urgent_periods, recovery_s, to_head, progress.done,
                   at_interruption, recovered, paths)
