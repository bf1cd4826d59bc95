"""The waypoint tree's judge (``bt.route.FollowRoute``): visits at the simulation's control
periods, read from the positions' stamps, on the window ``sim.interruption.run_route`` judges in
process. Positions go straight into a real node's world, in the order one writer sends them. And
the trees' wait for the policy node to take a task (``bt.reach.Taken``), on the events it says."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rclpy")

from py_trees.common import Status  # noqa: E402

from flashrt_ros.sim.waypoints import PERIODS_PER_WAYPOINT, Route  # noqa: E402

ROUTE = Route.sample(3, 2)   # two waypoints: a budget of 2 * PERIODS_PER_WAYPOINT periods
BUDGET = ROUTE.budget
FAR = np.array([5.0, 5.0])   # nowhere near a waypoint


@pytest.fixture
def world(ros_context):
    import rclpy

    from flashrt_ros.bt.route import RouteWorld

    node = rclpy.create_node("route_judge", context=ros_context)
    world = RouteWorld(node, "/judge_sim", "/judge")
    world.new_episode(ROUTE)
    yield world
    node.destroy_node()


def _at(world, period: int, xy) -> None:
    """The end effector's position of control period ``period``, as the simulation stamps it."""
    from geometry_msgs.msg import PoseStamped

    from flashrt_ros.ros.sim_node import stamp_of
    from flashrt_ros.sim.arm import CONTROL_PERIOD_S

    msg = PoseStamped()
    msg.header.stamp = stamp_of(period * CONTROL_PERIOD_S)
    msg.pose.position.x, msg.pose.position.y = float(xy[0]), float(xy[1])
    world._on_pose(msg)


def _follower(world):
    from flashrt_ros.bt.route import FollowRoute

    follow = FollowRoute("follow", world)
    follow.initialise()
    return follow


def _waypoint(k: int) -> np.ndarray:
    return np.asarray(ROUTE.waypoints[k][:2])


def test_positions_before_the_episode_and_its_period_zero_are_not_judged(world):
    _at(world, 40, _waypoint(0))   # the episode before's, still on its way
    _at(world, 0, _waypoint(0))    # the reset's state: in process, nothing judges it either
    follow = _follower(world)
    assert follow.update() == Status.RUNNING and world.visited == 0
    _at(world, 1, _waypoint(0))
    assert follow.update() == Status.RUNNING and world.visited == 1


def test_a_visit_at_the_last_period_of_the_budget_counts_and_one_after_it_does_not(world):
    _at(world, 0, FAR)
    follow = _follower(world)
    _at(world, 1, _waypoint(0))
    _at(world, BUDGET, _waypoint(1))
    assert follow.update() == Status.SUCCESS and world.visited == 2

    world.new_episode(ROUTE)
    _at(world, 0, FAR)
    follow = _follower(world)
    _at(world, 1, _waypoint(0))
    _at(world, BUDGET + 1, _waypoint(1))
    assert follow.update() == Status.FAILURE and world.visited == 1


def test_the_budget_ends_even_when_its_last_position_was_lost(world):
    _at(world, 0, FAR)
    follow = _follower(world)
    for period in range(1, BUDGET):
        _at(world, period, FAR)
    assert follow.update() == Status.RUNNING
    _at(world, BUDGET + 2, FAR)   # periods BUDGET and BUDGET + 1 never came
    assert follow.update() == Status.FAILURE


def test_a_later_run_judges_from_the_newest_position_with_the_budget_of_what_is_left(world):
    _at(world, 0, FAR)
    first = _follower(world)
    _at(world, 5, _waypoint(0))
    assert first.update() == Status.RUNNING and world.visited == 1
    for period in range(6, 21):   # an interruption: another behaviour takes these
        _at(world, period, FAR)
    world.take_positions()
    later = _follower(world)       # from period 20, one waypoint left
    _at(world, 20, _waypoint(1))   # before its window
    _at(world, 20 + PERIODS_PER_WAYPOINT + 1, _waypoint(1))   # after it
    assert later.update() == Status.FAILURE and world.visited == 1


def test_the_wait_for_a_task_ends_on_its_episode_start_and_fails_on_its_refusal(ros_context):
    import rclpy
    from geometry_msgs.msg import PoseArray

    from flashrt_ros.bt.reach import EpisodeStarts, Taken
    from flashrt_ros.msg import CapsuleEvent, CapsuleInfo

    node = rclpy.create_node("taken_judge", context=ros_context)
    try:
        starts = EpisodeStarts(node, "/judge")
        route_out = node.create_publisher(PoseArray, "/judge/route", 10)

        def said(success: bool, message: str, name: str = "episode-start") -> None:
            starts._on_event(CapsuleEvent(kind=CapsuleEvent.KIND_RESTORE, success=success, message=message,
                                          capsule=CapsuleInfo(name=name)))

        said(True, "~/route started an episode from capsule episode-start: 2 pose(s) for the next steps")
        starts.give()   # what came before the task went out is not its answer
        wait = Taken("route taken", starts, route_out)
        wait.ack_grace_s = 3600.0   # the fallback on acknowledgements (none to wait for here) kept out
        wait.initialise()
        assert wait.update() == Status.RUNNING
        said(False, "capsule 0123456789abcdef is not in the store")   # another client's ~/restore
        said(False, "~/route refused: it has no poses", name="elsewhere")
        assert wait.update() == Status.RUNNING
        said(False, "~/route refused: it is in frame 'world', the policy's is 'base_link' (policy.frame_id)")
        assert wait.update() == Status.FAILURE and "frame 'world'" in wait.feedback_message

        starts.give()
        wait.initialise()
        assert wait.update() == Status.RUNNING
        said(True, "~/route started an episode from capsule episode-start: 2 pose(s) for the next steps")
        assert wait.update() == Status.SUCCESS
    finally:
        node.destroy_node()
