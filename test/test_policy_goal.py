"""The policy node's goal mode, commands and limits, over real DDS: a goal starts an episode and
reaches the next observation only; commands are JointTrajectory messages named and stamped; a
pose in another frame is refused; a full context is said once, with CONTEXT_FULL."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("rclpy")

from flashrt_ros.errors import ErrorCode  # noqa: E402
from flashrt_ros.msg import CapsuleEvent  # noqa: E402
from ros_harness import Harness  # noqa: E402

JOINTS = ["joint1", "joint2", "joint3"]
GOAL_MODE = {"policy.obs_dim": 19, "policy.action_dim": 3, "policy.joint_names": JOINTS, "policy.goal": True,
             "policy.frame_id": "base_link"}


def _messages(h, stamp_s: float, frame: str = "base_link"):
    from builtin_interfaces.msg import Time
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import JointState

    stamp = Time(sec=int(stamp_s), nanosec=int(round((stamp_s % 1) * 1e9)))
    pose = PoseStamped()
    pose.header.stamp, pose.header.frame_id = stamp, frame
    pose.pose.position.x, pose.pose.orientation.w = 0.4, 1.0
    state = JointState(name=JOINTS, position=[0.1, 0.2, 0.3], velocity=[0.0] * 3)
    state.header.stamp = stamp
    return pose, state


def _until(predicate, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class _TaskGiver:
    """A client of the harness's policy node as a task giver is: the node's journal kept, its
    commands and events heard, a publisher of ``kind`` (goals or routes) on ``topic``, and one
    control period at a time."""

    def __init__(self, h, kind, topic: str) -> None:
        from trajectory_msgs.msg import JointTrajectory

        from flashrt_ros.serving.journal import Journal

        self.h, self.journal = h, Journal()
        h.node.session.journal = self.journal
        self.commands, self.events = [], []
        heard = h.client.create_subscription(JointTrajectory, "/flashrt/joint_trajectory", self.commands.append, 50)
        said = h.client.create_subscription(CapsuleEvent, "/flashrt/events", self.events.append, 50)
        self.tasks = h.client.create_publisher(kind, topic, 10)
        self.joints, self.poses = h.policy_publishers()
        _until(lambda: self.tasks.get_subscription_count() > 0 and heard.get_publisher_count() > 0
               and said.get_publisher_count() > 0 and h.node.count_subscribers("/flashrt/events") > 0, what="matched")

    def step(self, t: float, frame: str = "base_link", answered: bool = True) -> None:
        """One period of a robot's state publisher, the next once the policy has answered."""
        pose, state = _messages(self.h, t, frame)
        n = len(self.commands)
        self.poses.publish(pose)
        time.sleep(0.1)   # taken before the joint state (the node pairs the latest pose)
        self.joints.publish(state)
        if answered:
            _until(lambda: len(self.commands) == n + 1, what=f"the command answering t={t}")


def test_a_goal_starts_an_episode_and_is_in_the_next_observation_only(ros_context):
    from geometry_msgs.msg import PoseStamped

    h = Harness(ros_context, GOAL_MODE)
    try:
        giver = _TaskGiver(h, PoseStamped, "/flashrt/goal")
        journal, commands, events, goals, step = giver.journal, giver.commands, giver.events, giver.tasks, giver.step
        assert [c.name for c in h.node.session.list()] == ["episode-start"]   # made at configure, pinned

        for k in range(3):   # an episode before any goal
            step(1.0 + k)
        assert h.node.engine.position == 3
        goal = PoseStamped()
        goal.header.frame_id = "base_link"
        goal.pose.position.x, goal.pose.position.y = -0.2, 0.4
        goals.publish(goal)
        _until(lambda: any(e.kind == "restore" for e in events), what="the episode start's restore event")
        assert h.node.engine.position == 0 and events[-1].success and "~/goal started an episode" in events[-1].message
        for k in range(3):
            step(10.0 + k)
        steps = [e for e in journal.entries if e.kind == "step"]
        assert [s.request["observation"][-4:] for s in steps[-3:]] == [
            pytest.approx([-0.2, 0.4, 0.0, 1.0]), [0.0] * 4, [0.0] * 4]
        assert [e.kind for e in journal.entries].count("restore") == 1
        last = commands[-1]
        assert list(last.joint_names) == JOINTS and len(last.points) == 1 and len(last.points[0].positions) == 3
        assert (last.header.stamp.sec, last.header.stamp.nanosec) == (12, 0)   # the joint state it answers

        rejected = h.node.report.counters["rejected_observations"]
        step(20.0, frame="world", answered=False)   # the pose is refused: the joint state is too far from the last
        _until(lambda: h.node.report.counters["rejected_observations"] > rejected, what="a refusal")
    finally:
        h.close()


def test_a_route_starts_an_episode_and_gives_its_poses_one_per_step(ros_context):
    from geometry_msgs.msg import Pose, PoseArray

    h = Harness(ros_context, GOAL_MODE)
    try:
        giver = _TaskGiver(h, PoseArray, "/flashrt/route")
        journal, events, routes, step = giver.journal, giver.events, giver.tasks, giver.step

        step(1.0)
        route = PoseArray()
        route.header.frame_id = "base_link"
        for x, y in ((0.3, 0.1), (-0.2, 0.4)):
            pose = Pose()
            pose.position.x, pose.position.y = x, y
            route.poses.append(pose)
        routes.publish(route)
        # The restore goes out on ~/events, once the route is taken: what a task giver waits for.
        _until(lambda: any(e.kind == "restore" for e in events), what="the episode start's restore event")
        started = [e for e in events if e.kind == "restore"]
        assert len(started) == 1 and started[0].success and started[0].capsule.name == "episode-start"
        assert started[0].position == 0 and "~/route" in started[0].message and "2 pose(s)" in started[0].message
        for k in range(3):
            step(10.0 + k)
        steps = [e for e in journal.entries if e.kind == "step"]
        assert [s.request["observation"][-4:] for s in steps[-3:]] == [
            pytest.approx([0.3, 0.1, 0.0, 1.0]), pytest.approx([-0.2, 0.4, 0.0, 1.0]), [0.0] * 4]

        def refusal(n: int):
            _until(lambda: len([e for e in events if e.kind == "restore"]) == n, what=f"restore event {n}")
            said = [e for e in events if e.kind == "restore"][-1]
            assert not said.success and said.capsule.name == "episode-start" and said.position == 3
            assert h.node.engine.position == 3   # the episode goes on as it was
            return said

        routes.publish(PoseArray(header=route.header))   # no poses
        no_poses = refusal(2)
        assert no_poses.error_code == ErrorCode.INVALID_ARGUMENT and "~/route refused: it has no poses" in no_poses.message
        route.header.frame_id = "world"
        routes.publish(route)
        elsewhere = refusal(3)
        assert elsewhere.error_code == ErrorCode.INVALID_ARGUMENT and "frame 'world'" in elsewhere.message
        route.header.frame_id = "base_link"
        # The episode-start capsule dropped by a client: the restore is refused with its own code.
        h.node.session.drop(started[0].capsule.id)
        routes.publish(route)
        dropped = refusal(4)
        assert dropped.error_code == ErrorCode.UNKNOWN_CAPSULE and started[0].capsule.id in dropped.message
    finally:
        h.close()


def test_a_goal_waiting_with_a_joint_state_is_taken_first(ros_context):
    """A goal is for the states that follow it: when the node finds a goal and a joint state
    both waiting (its policy thread was busy), the state gets the goal. The policy thread is
    held inside a step by the engine lock while both arrive."""
    from geometry_msgs.msg import PoseStamped
    from rclpy.duration import Duration
    from trajectory_msgs.msg import JointTrajectory

    from flashrt_ros.serving.journal import Journal

    h = Harness(ros_context, GOAL_MODE)
    try:
        journal = Journal()
        h.node.session.journal = journal
        commands = []
        heard = h.client.create_subscription(JointTrajectory, "/flashrt/joint_trajectory", commands.append, 50)
        goals = h.client.create_publisher(PoseStamped, "/flashrt/goal", 10)
        joints, poses = h.policy_publishers()
        _until(lambda: goals.get_subscription_count() > 0 and heard.get_publisher_count() > 0, what="matched")
        goal = PoseStamped()
        goal.header.frame_id = "base_link"
        goal.pose.position.x, goal.pose.position.y = -0.2, 0.4
        lock = h.node.session.engine.lock
        pose, first = _messages(h, 1.0)
        poses.publish(pose)
        time.sleep(0.1)   # taken before the joint state (the node pairs the latest pose)
        with lock:
            joints.publish(first)
            _until(lambda: len(lock._queue) == 1, what="the policy thread waiting inside the first step")
            pose, second = _messages(h, 2.0)
            poses.publish(pose)
            goals.publish(goal)
            joints.publish(second)
            for publisher in (poses, goals, joints):   # in the node's readers: all waiting at once
                assert publisher.wait_for_all_acked(Duration(seconds=10))
        _until(lambda: len(commands) == 2, what="both steps answered")
        steps = [e for e in journal.entries if e.kind == "step"]
        assert [s.request["observation"][-4:] for s in steps] == [[0.0] * 4, pytest.approx([-0.2, 0.4, 0.0, 1.0])]
    finally:
        h.close()

def test_a_full_context_is_said_once_with_context_full(ros_context):
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus

    h = Harness(ros_context, {**GOAL_MODE, "policy.goal": False, "policy.obs_dim": 15, "max_seq_len": 16,
                              "status_rate": 20.0})
    try:
        events, diagnostics = [], []
        h.client.create_subscription(CapsuleEvent, "/flashrt/events", events.append, 50)
        h.client.create_subscription(DiagnosticArray, "/diagnostics", diagnostics.append, 50)
        joints, poses = h.policy_publishers()
        pose, _ = _messages(h, 1.0)
        poses.publish(pose)
        time.sleep(0.2)
        for k in range(19):
            joints.publish(_messages(h, 1.0)[1])
            time.sleep(0.05)
        _until(lambda: h.node.report.counters["rejected_observations"] == 3, what="three refused steps")
        assert h.node.engine.position == 16
        full = [e for e in events if e.kind == "context_full"]
        assert len(full) == 1 and full[0].error_code == ErrorCode.CONTEXT_FULL and "max_seq_len=16" in full[0].message
        _until(lambda: any(s.level == DiagnosticStatus.ERROR and "context full" in s.message
                           for d in diagnostics for s in d.status), what="an ERROR on /diagnostics")
        assert h.call("rollback", steps=2).success   # room again: steps are taken
        joints.publish(_messages(h, 1.0)[1])
        _until(lambda: h.node.engine.position == 15, what="a step after the rollback")
    finally:
        h.close()


def test_commands_for_a_controller_that_starts_them_now_are_unstamped(ros_context):
    from trajectory_msgs.msg import JointTrajectory

    h = Harness(ros_context, {**GOAL_MODE, "policy.command_stamp": "zero"})
    try:
        commands = []
        heard = h.client.create_subscription(JointTrajectory, "/flashrt/joint_trajectory", commands.append, 10)
        joints, poses = h.policy_publishers()
        _until(lambda: heard.get_publisher_count() > 0, what="matched")
        pose, state = _messages(h, 7.5)
        poses.publish(pose)
        time.sleep(0.1)
        joints.publish(state)
        _until(lambda: len(commands) == 1, what="a command")
        assert (commands[0].header.stamp.sec, commands[0].header.stamp.nanosec) == (0, 0)
        assert list(commands[0].joint_names) == JOINTS
    finally:
        h.close()
