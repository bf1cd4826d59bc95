"""The simulated arm (MuJoCo) and its node: deterministic, refusing bad commands, over real DDS."""
from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

pytest.importorskip("mujoco")

from flashrt_ros.errors import InvalidArgument  # noqa: E402
from flashrt_ros.sim.arm import JOINT_NAMES, Arm  # noqa: E402
from flashrt_ros.sim.task import ATTEMPT_STEPS, SUCCESS_RADIUS_M, Episode, distance, expert  # noqa: E402



def _spin(ros_context, *nodes):
    """An executor spinning ``nodes`` on a thread of its own; what it returns stops it and
    destroys them."""
    from rclpy.executors import SingleThreadedExecutor

    executor = SingleThreadedExecutor(context=ros_context)
    for node in nodes:
        executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()

    def stop() -> None:
        executor.shutdown()
        spinner.join(5)
        for node in nodes:
            node.destroy_node()
    return stop

def _sim_and_client(ros_context, client_name: str, *overrides):
    """A SimNode with parameter ``overrides``, and a client node that hears its joint states
    (into the list returned) and publishes commands to it."""
    from sensor_msgs.msg import JointState
    from trajectory_msgs.msg import JointTrajectory

    import rclpy

    from flashrt_ros.ros.sim_node import SimNode

    sim = SimNode(context=ros_context, parameter_overrides=list(overrides))
    client = rclpy.create_node(client_name, context=ros_context)
    states = []
    client.create_subscription(JointState, "/joint_states", states.append, 100)
    return sim, client, states, client.create_publisher(JointTrajectory, "/joint_trajectory", 10)


def _run(seed: int, jam: bool = False) -> list[np.ndarray]:
    arm = Arm()
    episode = Episode.sample(seed)
    state = arm.reset(episode.start)
    out = []
    for t in range(ATTEMPT_STEPS):
        if jam and t == 2:
            arm.block(0)
        arm.command(expert(state, episode.goal))
        state = arm.advance()
        out.append(np.concatenate([state.position, state.velocity, state.ee_position]))
    return out


def test_the_arm_is_deterministic_for_a_seed_and_the_expert_reaches_unless_jammed():
    first, again = _run(3), _run(3)
    assert all((a == b).all() for a, b in zip(first, again))   # bit for bit
    reached = jammed = 0
    for seed in range(20):
        episode = Episode.sample(seed)
        arm = Arm()
        for jam in (False, True):
            state = arm.reset(episode.start)
            for t in range(ATTEMPT_STEPS):
                if jam and t == 2:
                    arm.block(0)
                arm.command(expert(state, episode.goal))
                state = arm.advance()
            if jam:
                jammed += distance(state, episode.goal) < SUCCESS_RADIUS_M
            else:
                reached += distance(state, episode.goal) < SUCCESS_RADIUS_M
    # The task's premise: the expert always reaches, and a jammed shoulder always makes it miss.
    assert reached == 20 and jammed == 0


@pytest.mark.parametrize("names, positions, why", [
    (["joint1", "joint2", "elbow"], [0.0, 0.0, 0.0], "names joints"),
    (list(JOINT_NAMES), [0.0, float("nan"), 0.0], "NaN"),
    (list(JOINT_NAMES), [0.0, 3.5, 0.0], "outside"),
    (list(JOINT_NAMES), [0.0, 0.0], "positions"),
])
def test_bad_commands_are_refused_with_the_reason(names, positions, why):
    with pytest.raises(InvalidArgument, match=why):
        Arm().check_command(names, positions)


def test_a_command_in_another_joint_order_is_taken_by_name():
    target = Arm().check_command(["joint3", "joint1", "joint2"], [0.3, 0.1, 0.2])
    assert target.tolist() == [0.1, 0.2, 0.3]


def test_the_sim_node_steps_in_lockstep_refuses_bad_commands_and_keeps_running(ros_context):
    from rclpy.parameter import Parameter
    from rclpy.qos import DurabilityPolicy, QoSProfile
    from geometry_msgs.msg import PoseStamped
    from rosgraph_msgs.msg import Clock
    from sensor_msgs.msg import JointState
    from std_srvs.srv import SetBool, Trigger
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    import rclpy

    from flashrt_ros.ros.sim_node import SimNode
    from ros_harness import wait_future

    sim = SimNode(context=ros_context, parameter_overrides=[Parameter("lockstep", value=True),
                                                            Parameter("seed", value=4),
                                                            Parameter("lockstep_patience", value=0.5)])
    client = rclpy.create_node("sim_client", context=ros_context)
    states, clocks, goals = [], [], []
    client.create_subscription(JointState, "/joint_states", states.append, 50)
    client.create_subscription(Clock, "/clock", clocks.append, 50)
    client.create_subscription(PoseStamped, "/flashrt_sim/episode_goal", goals.append,
                               QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL))
    commands = client.create_publisher(JointTrajectory, "/joint_trajectory", 10)
    jam = client.create_client(SetBool, "/flashrt_sim/jam")
    stop = _spin(ros_context, sim, client)

    def wait(what, n, timeout=10.0):
        deadline = time.monotonic() + timeout
        while len(what) < n:
            assert time.monotonic() < deadline, f"{len(what)} of {n}"
            time.sleep(0.01)

    def command(positions, names=JOINT_NAMES, stamp=None):
        msg = JointTrajectory(joint_names=list(names), points=[JointTrajectoryPoint(positions=list(positions))])
        msg.header.stamp = states[-1].header.stamp if stamp is None else stamp
        commands.publish(msg)

    try:
        deadline = time.monotonic() + 10
        while commands.get_subscription_count() == 0 or client.count_publishers("/joint_states") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reset = client.create_client(Trigger, "/flashrt_sim/reset")
        assert reset.wait_for_service(timeout_sec=10)
        assert wait_future(reset.call_async(Trigger.Request())).success
        wait(states, 1)
        wait(goals, 1)
        goal = np.array([goals[-1].pose.position.x, goals[-1].pose.position.y, 0.0])
        assert np.allclose(goal, Episode.sample(4).goal)
        for k in range(12):   # each answer to the latest state steps one control period
            state = states[-1]
            command(np.asarray(state.position) + 0.1)
            wait(states, len(states) + 1)
        stamp = states[-1].header.stamp   # twelve control periods of 0.05 s of simulation time
        assert (stamp.sec, stamp.nanosec) == (0, 600_000_000)
        assert clocks and clocks[-1].clock == states[-1].header.stamp
        held = sim.arm.data.ctrl.copy()
        n = len(states)
        command([0.0, float("nan"), 0.0])   # refused, but it answers: a step with the targets held
        wait(states, n + 1)
        command([0.0, 0.0, 0.0], names=["a", "b", "c"])
        wait(states, n + 2)
        assert sim.refused == 2 and (sim.arm.data.ctrl == held).all()
        old = states[-1].header.stamp.__class__(sec=0, nanosec=1)   # 0.7 s ago: older than max_command_age
        command([0.0, 0.0, 0.0], stamp=old)
        ahead = states[-1].header.stamp.__class__(sec=5, nanosec=0)   # not yet in simulation time
        command([0.0, 0.0, 0.0], stamp=ahead)
        deadline = time.monotonic() + 5
        while sim.refused < 4:
            assert time.monotonic() < deadline, f"refused {sim.refused}"
            time.sleep(0.01)
        # Nobody answered the latest state: after lockstep_patience it is stepped all the same.
        wait(states, n + 3, timeout=5.0)
        assert sim.unanswered >= 1 and (sim.arm.data.ctrl == held).all()
        # A reset says what the loop lost so far, then starts the episode again at time zero.
        seen = len(states)
        said = wait_future(reset.call_async(Trigger.Request())).message
        assert f"{sim.refused} commands refused" in said and re.search(r"since the start, [1-9]\d* states stepped", said)
        deadline = time.monotonic() + 5
        while not any(s.header.stamp.sec == 0 and s.header.stamp.nanosec == 0 for s in states[seen:]):
            assert time.monotonic() < deadline, "no state of the new episode"
            time.sleep(0.01)
        assert wait_future(jam.call_async(SetBool.Request(data=True))).success
        held = states[-1].position[0]
        for _ in range(3):
            command([held + 1.0, 0.0, 0.0])
            wait(states, len(states) + 1)
        assert abs(states[-1].position[0] - held) < 1e-3   # jammed
    finally:
        stop()


def test_a_held_sim_node_steps_no_more_once_the_state_out_is_answered_until_the_next_reset(ros_context):
    from rclpy.parameter import Parameter
    from std_srvs.srv import Trigger
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    from ros_harness import wait_future

    # A patience longer than any wait of this test's own: only the state left unanswered on purpose
    # at its end runs out of it.
    sim, client, states, commands = _sim_and_client(ros_context, "sim_hold_client", Parameter("lockstep", value=True),
                                                    Parameter("lockstep_patience", value=4.0))
    reset = client.create_client(Trigger, "/flashrt_sim/reset")
    hold = client.create_client(Trigger, "/flashrt_sim/hold")
    stop = _spin(ros_context, sim, client)

    def answer() -> None:
        msg = JointTrajectory(joint_names=list(JOINT_NAMES),
                              points=[JointTrajectoryPoint(positions=list(states[-1].position))])
        msg.header.stamp = states[-1].header.stamp
        commands.publish(msg)

    def until(predicate, what: str) -> None:
        deadline = time.monotonic() + 10
        while not predicate():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    try:
        assert hold.wait_for_service(timeout_sec=10) and reset.wait_for_service(timeout_sec=10)
        until(lambda: commands.get_subscription_count() > 0, "matched")
        before = wait_future(hold.call_async(Trigger.Request()))
        assert before.success and "held" in before.message   # nothing out yet: held at once
        assert wait_future(reset.call_async(Trigger.Request())).success
        until(lambda: len(states) == 1, "the episode's first state")
        answer()
        until(lambda: len(states) == 2, "the next state")
        # The state out awaits its answer: not held yet, and asking again changes nothing.
        for _ in range(2):
            waiting = wait_future(hold.call_async(Trigger.Request()))
            assert not waiting.success and "waiting for the answer to the state at t=0.050" in waiting.message
        answer()   # taken, but time stands still: no state goes out
        until(lambda: wait_future(hold.call_async(Trigger.Request())).success, "held once answered")
        time.sleep(0.3)
        assert len(states) == 2 and sim.arm.state().time == pytest.approx(0.05)
        answer()   # an answer to a state already answered steps nothing either
        time.sleep(0.3)
        assert len(states) == 2 and sim.unanswered == 0
        # The next reset starts the episode and the loop again.
        assert wait_future(reset.call_async(Trigger.Request())).success
        until(lambda: len(states) == 3, "the new episode's first state")
        answer()
        until(lambda: len(states) == 4, "a step after the reset")
        assert (states[-1].header.stamp.sec, states[-1].header.stamp.nanosec) == (0, 50_000_000)
        # A reset while a hold waits for its answer ends the hold: the new episode runs.
        assert not wait_future(hold.call_async(Trigger.Request())).success
        assert wait_future(reset.call_async(Trigger.Request())).success
        until(lambda: len(states) == 5, "the reset's first state")
        answer()
        until(lambda: len(states) == 6, "a step of the new episode")
        # A state nobody answers within the patience: the hold is done all the same, the state
        # counted unanswered, and no state goes out.
        assert not wait_future(hold.call_async(Trigger.Request())).success
        until(lambda: wait_future(hold.call_async(Trigger.Request())).success, "held after the patience")
        assert sim.unanswered == 1
        time.sleep(0.3)
        assert len(states) == 6
    finally:
        stop()


def test_the_sim_node_on_its_timer_publishes_from_the_start_faster_than_real_time_and_stands_still_held(ros_context):
    from rclpy.parameter import Parameter
    from sensor_msgs.msg import JointState
    from std_srvs.srv import Trigger

    import rclpy

    from flashrt_ros.ros.sim_node import SimNode
    from ros_harness import wait_future

    sim = SimNode(context=ros_context, parameter_overrides=[Parameter("speed", value=10.0)])
    client = rclpy.create_node("sim_timer_client", context=ros_context)
    states = []
    client.create_subscription(JointState, "/joint_states", states.append, 100)
    stop = _spin(ros_context, sim, client)
    try:
        deadline = time.monotonic() + 10
        while len(states) < 20:   # 20 control periods: 1 s of simulation time, 0.1 s of wall clock at 10x
            assert time.monotonic() < deadline, len(states)
            time.sleep(0.01)
        stamps = [s.header.stamp.sec + s.header.stamp.nanosec * 1e-9 for s in states[-10:]]
        assert all(abs((b - a) - 0.05) < 1e-9 for a, b in zip(stamps, stamps[1:]))   # one period each
        # Held, the timer steps nothing (no state awaits an answer: held at once) until a reset.
        hold = client.create_client(Trigger, "/flashrt_sim/hold")
        reset = client.create_client(Trigger, "/flashrt_sim/reset")
        assert hold.wait_for_service(timeout_sec=10) and reset.wait_for_service(timeout_sec=10)
        assert wait_future(hold.call_async(Trigger.Request())).success
        held_at = sim.arm.state().time
        time.sleep(0.3)   # sixty periods at 10x
        assert sim.arm.state().time == held_at
        assert all(s.header.stamp.sec + s.header.stamp.nanosec * 1e-9 <= held_at + 1e-9 for s in states)
        n = len(states)
        assert wait_future(reset.call_async(Trigger.Request())).success
        deadline = time.monotonic() + 10
        while len(states) < n + 5:
            assert time.monotonic() < deadline, "the timer steps again after the reset"
            time.sleep(0.01)
    finally:
        stop()


def test_the_sim_node_refuses_out_of_range_parameters_answers_every_reset_and_drops_huge_commands(ros_context):
    from rcl_interfaces.msg import Parameter as ParameterMsg
    from rcl_interfaces.msg import ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters
    from rclpy.parameter import Parameter
    from std_srvs.srv import Trigger
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    from flashrt_ros.ros.sim_node import SimNode
    from ros_harness import wait_future

    with pytest.raises(Exception, match="seed"):   # at start, rclpy refuses it against the range
        SimNode(context=ros_context, parameter_overrides=[Parameter("seed", value=-1)])
    sim, client, states, commands = _sim_and_client(ros_context, "sim_param_client", Parameter("speed", value=10.0))
    setter = client.create_client(SetParameters, "/flashrt_sim/set_parameters")
    reset = client.create_client(Trigger, "/flashrt_sim/reset")
    stop = _spin(ros_context, sim, client)

    def set_parameter(name, value):
        kind = ParameterType.PARAMETER_INTEGER if isinstance(value, int) else ParameterType.PARAMETER_STRING
        field = "integer_value" if isinstance(value, int) else "string_value"
        msg = ParameterMsg(name=name, value=ParameterValue(type=kind, **{field: value}))
        return wait_future(setter.call_async(SetParameters.Request(parameters=[msg])), 10).results[0]

    try:
        assert setter.wait_for_service(timeout_sec=10) and reset.wait_for_service(timeout_sec=10)
        for name, value in (("seed", -1), ("frame_id", ""), ("max_command_bytes", 0)):
            result = set_parameter(name, value)
            assert not result.successful and result.reason, (name, value)
        assert sim.get_parameter("seed").value == 0
        assert wait_future(reset.call_async(Trigger.Request()), 10).success
        # A fault inside the simulator is an answer too, not a traceback and a client left waiting.
        sim.arm.reset = lambda start: (_ for _ in ()).throw(RuntimeError("the model would not load"))
        broken = wait_future(reset.call_async(Trigger.Request()), 10)
        assert not broken.success and "would not load" in broken.message

        deadline = time.monotonic() + 10
        while commands.get_subscription_count() == 0 or len(states) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        huge = JointTrajectory(joint_names=list(JOINT_NAMES),
                               points=[JointTrajectoryPoint(positions=[0.1, 0.2, 0.3])] * 20_000)
        commands.publish(huge)   # refused by its size, before its points are parsed
        deadline = time.monotonic() + 10
        while sim.refused < 1:
            assert time.monotonic() < deadline, "the oversized command was not refused"
            time.sleep(0.01)
        n = len(states)
        deadline = time.monotonic() + 10
        while len(states) < n + 5:   # the timer still steps and publishes
            assert time.monotonic() < deadline
            time.sleep(0.01)
        commands.publish(JointTrajectory(joint_names=list(JOINT_NAMES),
                                         points=[JointTrajectoryPoint(positions=[0.1, 0.2, 0.3])]))
        deadline = time.monotonic() + 10
        while not np.allclose(sim.arm.data.ctrl[:3], [0.1, 0.2, 0.3]):   # a command of a usual size is taken
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sim.refused == 1
    finally:
        stop()
