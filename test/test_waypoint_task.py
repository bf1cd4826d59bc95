"""The waypoint task and its interruption: seeded episodes, the judge, the expert, the heading
measure (no policy, no ROS)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mujoco")

from flashrt_ros.sim.arm import Arm, ArmState  # noqa: E402
from flashrt_ros.sim.interruption import (HEADING_PERIODS, URGENT_HOLD, Interrupted, expert_finish,  # noqa: E402
                                          heading)
from flashrt_ros.sim.task import JOINT_LIMIT, reach_pose  # noqa: E402
from flashrt_ros.sim.waypoints import (MIN_SEPARATION_M, REACH_RADII_M, ROUTE_LENGTH, Progress, Route,  # noqa: E402
                                       RouteExpert, end_effector, route_observation)


def _same(a: Interrupted, b: Interrupted) -> bool:
    return (a.period == b.period and a.hold == b.hold and (a.point == b.point).all()
            and (a.route.start == b.route.start).all()
            and all((x == y).all() for x, y in zip(a.route.waypoints, b.route.waypoints)))


def test_episodes_are_the_same_for_a_seed_and_valid():
    arm = Arm()
    for seed in range(20):
        episode = Interrupted.sample(seed, arm)
        assert _same(episode, Interrupted.sample(seed, arm))
        route = episode.route
        assert len(route.waypoints) == ROUTE_LENGTH and route.budget == 90
        points = [end_effector(route.start), *route.waypoints]
        for i, a in enumerate(points):
            for b in points[i + 1:]:
                assert np.linalg.norm(a[:2] - b[:2]) >= MIN_SEPARATION_M
        for w in (*route.waypoints, episode.point):
            assert REACH_RADII_M[0] <= np.linalg.norm(w[:2]) <= REACH_RADII_M[1] and w[2] == 0.0
            assert np.abs(reach_pose(w)).max() <= JOINT_LIMIT
        assert all(np.linalg.norm(episode.point[:2] - w[:2]) >= MIN_SEPARATION_M for w in route.waypoints)
        assert ROUTE_LENGTH + 2 <= episode.period <= max(ROUTE_LENGTH + 2, expert_finish(route, arm) - 3)
        assert URGENT_HOLD[0] <= episode.hold <= URGENT_HOLD[1]
    assert not _same(Interrupted.sample(0, arm), Interrupted.sample(1, arm))


def test_the_route_is_given_once_one_waypoint_per_period():
    route = Route.sample(3)
    state = Arm().reset(route.start)
    blocks = [route_observation(state, route.waypoints, t)[-4:] for t in range(5)]
    for t, waypoint in enumerate(route.waypoints):
        assert (blocks[t] == np.array([*waypoint, 1.0], dtype=np.float32)).all()
    assert (blocks[3] == 0).all() and (blocks[4] == 0).all()


def _at(xy: tuple[float, float]) -> ArmState:
    zero = np.zeros(3)
    return ArmState(0.0, zero, zero, np.array([*xy, 0.0]), np.array([1.0, 0.0, 0.0, 0.0]))


def test_a_visit_counts_only_for_the_next_waypoint():
    a, b = np.array([0.4, 0.0, 0.0]), np.array([0.0, 0.4, 0.0])
    progress = Progress([a, b])
    assert not progress.update(_at((0.0, 0.41)))          # b before a: nothing
    assert not progress.update(_at((0.44, 0.0)))          # 4 cm from a: not a visit
    assert progress.update(_at((0.42, 0.0))) and progress.visited == 1
    assert progress.update(_at((0.0, 0.38))) and progress.done and progress.remaining == ()


def test_the_expert_does_every_route_in_time_and_resumes_after_an_excursion():
    arm = Arm()
    for seed in range(10):
        episode = Interrupted.sample(seed, arm)
        route = episode.route
        state, guide, judge = arm.reset(route.start), RouteExpert(route.waypoints), Progress(route.waypoints)
        for _ in range(episode.period):
            judge.update(state)
            arm.command(guide.label(state))
            state = arm.advance()
        excursion = RouteExpert([episode.point])
        for _ in range(30):
            arm.command(excursion.label(state))
            state = arm.advance()
        guide.resume()
        left = len(judge.remaining)
        for _ in range(30 * left):
            arm.command(guide.label(state))
            state = arm.advance()
            judge.update(state)
            if judge.done:
                break
        assert left >= 1 and judge.done, (seed, left, judge.visited)


def test_heading_is_the_first_of_three_periods_moving_toward_the_reach_pose():
    waypoint = np.array([0.5, 0.2, 0.0])
    pose = reach_pose(waypoint)
    start = pose + np.array([1.0, 0.0, 0.0])
    away = [start + np.array([0.1 * k, 0.0, 0.0]) for k in range(3)]   # two periods moving away
    toward = [away[-1] - (away[-1] - pose) * 0.1 * k for k in range(1, 6)]
    assert heading(away + toward, waypoint, None) == 3
    assert heading(away, waypoint, None) is None
    assert heading([start] * 2, waypoint, visited_at=1) == 1   # a visit has headed there
    still = [start] * (HEADING_PERIODS + 3)
    assert heading(still, waypoint, None) is None
